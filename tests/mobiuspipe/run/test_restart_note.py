"""The line a job torchrun restarts (--max-restarts) prints first: a restart is not silent."""

from __future__ import annotations

from mobiuspipe.run.train import restart_note


def test_a_restarted_job_says_so_with_its_count_and_resume():
    env = {"TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_MAX_RESTARTS": "3", "RANK": "0"}
    assert restart_note(env, "auto") == (
        "mobiuspipe: torchrun started the ranks again after a rank failed (restart 2 of at most 3, --max-restarts); "
        "train.resume auto: the run goes on from its newest complete checkpoint"
    )
    assert restart_note({**env, "RANK": "1"}, "auto") is None  # rank 0 says it
    assert restart_note({**env, "TORCHELASTIC_RESTART_COUNT": "0"}, "auto") is None  # the first attempt
    assert restart_note({}, None) is None  # not under torchrun's agent
    assert "no train.resume: the run starts again at step 0" in str(restart_note(env, None))

"""How long torchrun lets the ranks stop after Ctrl-C or SIGTERM: they finish the step under way and write a
checkpoint, which on a large model takes far more than torchrun's default 30 s before its SIGKILL."""

from __future__ import annotations

from mobiuspipe.config import config_from_dict


def test_torchrun_waits_for_the_ranks_to_stop_as_long_as_a_hang_may_last(monkeypatch):
    from mobiuspipe.cli import train as cli_train

    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    cfg = config_from_dict({"runtime": {"hang_timeout_s": 900}})
    assert cli_train.stop_grace_env(cfg) == {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "900"}
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "45")  # the user's own setting stands
    assert cli_train.stop_grace_env(cfg) == {}

"""The probe of the host update's rate runs CPUAdam in every rank's process at once and says how."""

from __future__ import annotations

from mobiuspipe.optim.adam_rate import probe_rank_adam


def test_the_probe_steps_every_rank_at_once_and_says_how():
    notes: list[str] = []
    rate = probe_rank_adam(notes, ranks=2, threads=1, params=300_000, repeats=2)
    assert rate > 1e5  # parameters per second: the smallest machine steps millions
    assert len(notes) == 1 and "CPUAdam" in notes[0] and "1 threads in each of 2 ranks" in notes[0]

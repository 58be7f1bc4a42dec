"""Stopwatch: seconds since its start; frozen at the end of a `with` block."""

import time

from foundation.timing import Stopwatch


def test_counts_from_its_start():
    watch = Stopwatch()
    first = watch.s
    time.sleep(0.01)
    assert 0 <= first < watch.s and watch.s >= 0.01


def test_frozen_when_the_block_ends():
    with Stopwatch() as watch:
        time.sleep(0.01)
    ended = watch.s
    time.sleep(0.01)
    assert watch.s == ended >= 0.01


def test_with_restarts_it():
    watch = Stopwatch()
    time.sleep(0.02)
    with watch:
        pass
    assert watch.s < 0.02

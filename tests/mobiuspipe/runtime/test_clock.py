"""The action clock: the host's clock on the stand-in; on a GPU, CUDA events that measure what the compute stream
did, not when the host launched it."""

from __future__ import annotations

import time

import pytest
import torch

from mobiuspipe.runtime.clock import ActionClock


def test_the_standin_clock_is_the_hosts():
    clock = ActionClock()
    clock.start_step()
    a = clock.mark()
    time.sleep(0.02)
    b = clock.mark()
    assert not clock.on_device and 0.02 <= clock.seconds(b) - clock.seconds(a) < 1.0
    span = clock.seconds(b) - clock.seconds(a)
    assert clock.buckets([("F", a, b), ("L", a, a), ("RA", b, b)]) == {"compute": span, "load": 0.0, "comm": 0.0}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_marks_measure_the_stream_not_the_launch():
    stream = torch.cuda.current_stream()
    clock = ActionClock(stream)
    clock.start_step()
    a = clock.mark()
    launched = time.perf_counter()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of spinning on the stream at ~2 GHz, launched at once
    launched = time.perf_counter() - launched
    b = clock.mark()
    clock.settle(b)  # the one host wait: a, before b on the stream, has passed too
    span = clock.seconds(b) - clock.seconds(a)
    assert launched < 0.01 < 0.03 < span and clock.seconds(a) >= clock._t0

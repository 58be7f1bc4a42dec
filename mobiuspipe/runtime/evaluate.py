"""Evaluation through the pipeline: a batch's loss with no gradient, no recompute and no update.

Each rank visits its stages in order: load the stage's weights into the arena (after its pending update),
run every microbatch through it in eval mode (dropout off), hand each output to the next stage (on this
rank, or sent with its shape header to the rank that holds it) and release the slot. The last stage adds
each microbatch's loss / num_microbatches. A rank only ever waits for a lower stage, which its holder
visits before any higher one, so the visit order cannot deadlock.
"""

from __future__ import annotations

import torch

from mobiuspipe.runtime.comm import TensorSpec
from mobiuspipe.runtime.engine import Engine

__all__ = ["eval_loss"]

TAG_BASE = (1 << 30) + (1 << 24)
"""Message tags of evaluation: above every training tag (< 2^30) and the tied-gradient exchange's."""


def eval_loss(engine: Engine, x: torch.Tensor, y: torch.Tensor, what: str) -> float:
    """This rank's share of the batch's mean loss (nonzero on the last stage's rank only)."""
    m, last = engine.num_microbatches, engine.last
    xs, ys = x.chunk(m), y.chunk(m)
    handed: dict[tuple[int, int], torch.Tensor] = {}
    total = 0.0
    modes = {j: [layer.training for layer in s.layers.values()] for j, s in engine.stages.items()}
    for s in engine.stages.values():
        for layer in s.layers.values():
            layer.eval()
    try:
        for j in sorted(engine.stages):
            stage = engine.stages[j]
            stage.load(engine.arena)
            stage.wait_loaded()
            try:
                for i in range(m):
                    with torch.no_grad():
                        out = stage.forward(_input(engine, j, i, xs, handed, what), with_grad=False)
                    if j == last:
                        total += float(engine.loss_fn(out.float(), ys[i].to(out.device))) / m
                    elif engine.mapping[j + 1] == engine.rank:
                        handed[(j + 1, i)] = out
                    else:
                        _send(engine, out, j, i, what)
            finally:
                stage.release(engine.arena)
        engine.comm.flush()
    finally:
        for j, s in engine.stages.items():
            for layer, mode in zip(s.layers.values(), modes[j]):
                layer.train(mode)
    return total


def _tag(engine: Engine, j: int, i: int, header: bool) -> int:
    return TAG_BASE + (j * engine.num_microbatches + i) * 2 + header


def _input(engine: Engine, j: int, i: int, xs, handed: dict, what: str) -> torch.Tensor:
    """Stage j's input for microbatch i: the batch's (stage 0), handed over on this rank, or received."""
    dev = engine.device.torch_device
    if j == 0:
        x = xs[i]
        return engine.device.to_device(x, engine.dtype if x.is_floating_point() else x.dtype)
    if (j, i) in handed:
        return handed.pop((j, i))
    src = engine.mapping[j - 1]
    what = f"the activation of stage {j - 1} microbatch {i} ({what})"
    spec = engine.comm.recv_spec(dev, src, _tag(engine, j - 1, i, True), what)
    return engine.comm.recv(spec, dev, src, _tag(engine, j - 1, i, False), what)


def _send(engine: Engine, out: torch.Tensor, j: int, i: int, what: str) -> None:
    dst, what = engine.mapping[j + 1], f"the activation of stage {j} microbatch {i} ({what})"
    engine.comm.send_spec(TensorSpec.of(out, what), out.device, dst, _tag(engine, j, i, True), what)
    engine.comm.send(out, dst, _tag(engine, j, i, False), what)

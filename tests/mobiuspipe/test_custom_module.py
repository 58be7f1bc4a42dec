"""A user-defined module (examples/custom_module.py, not the built-in GPT) trained through the public Pipeline
equals plain PyTorch training: on 2 ranks with 4 stages under torchrun, and in one process."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mobiuspipe import Pipeline
from mobiuspipe.errors import PipelineError
from mobiuspipe.optim import CPUAdam
from partition import PlanInfeasibleError
from topology import cpu_standin

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_module.py"


def _example():
    spec = importlib.util.spec_from_file_location("custom_module_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _plain_pytorch(ex, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The example's model as one nn.Sequential, its optimizer, the same microbatches, no pipeline."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = nn.Sequential(*(make() for make in ex.layer_factories()))
        opt = ex.optimizer(list(model.parameters()))
        losses = []
        for step in range(steps):
            x, y = ex.batch(step)
            opt.zero_grad()
            total = 0.0
            for xi, yi in zip(x.chunk(ex.MICROBATCHES), y.chunk(ex.MICROBATCHES)):
                loss = F.mse_loss(model(xi), yi) / ex.MICROBATCHES
                loss.backward()
                total += loss.item()
            opt.step()
            losses.append(total)
        return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
    finally:
        torch.set_num_threads(threads)


def _assert_same(losses, weights, ref_losses, ref_weights):
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert weights.keys() == ref_weights.keys()
    for k in weights:
        torch.testing.assert_close(weights[k], ref_weights[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.slow
def test_example_on_two_ranks_equals_plain_pytorch(tmp_path):
    steps = 6
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(EXAMPLE),
        "--steps",
        str(steps),
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "4 stages on 2 ranks" in proc.stdout
    losses = json.loads((tmp_path / "losses.json").read_text())
    weights = {**torch.load(tmp_path / "weights-rank0.pt"), **torch.load(tmp_path / "weights-rank1.pt")}
    _assert_same(losses, weights, *_plain_pytorch(_example(), steps))


def test_in_process_pipeline_equals_plain_pytorch():
    ex = _example()
    torch.set_num_threads(1)
    with Pipeline(
        ex.layer_factories(),
        F.mse_loss,
        optimizer=ex.optimizer,
        sample=ex.batch(0),
        num_microbatches=ex.MICROBATCHES,
        num_stages=ex.STAGES,
    ) as pipe:
        assert pipe.plan.num_stages == 4 and pipe.plan.num_gpus == 1
        losses = [pipe.train_batch(*ex.batch(step)).loss for step in range(3)]
        weights = pipe.state_dict()
    _assert_same(losses, weights, *_plain_pytorch(ex, 3))


def test_modules_with_buffers_and_a_given_plan():
    """Modules (not factories) with a registered buffer; the plan made from one Pipeline's profile drives another."""

    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(5, 5)
            self.register_buffer("scale", torch.full((5,), 0.5))

        def forward(self, x):
            return self.lin(x) * self.scale

    def build():
        torch.manual_seed(3)
        return [Scale(), nn.Tanh(), Scale(), nn.Linear(5, 2)]

    x, y = torch.randn(6, 5), torch.randn(6, 2)
    opt = partial(CPUAdam, lr=0.01)
    first_layers = build()
    with Pipeline(first_layers, F.mse_loss, optimizer=opt, sample=(x, y), num_microbatches=3, num_stages=3) as first:
        plan = first.plan
    model = nn.Sequential(*build())
    ref_opt = opt(list(model.parameters()))
    with Pipeline(nn.Sequential(*build()), F.mse_loss, optimizer=opt, plan=plan) as pipe:
        for _ in range(2):
            got = pipe.train_batch(x, y).loss
            ref_opt.zero_grad()
            want = 0.0
            for xi, yi in zip(x.chunk(3), y.chunk(3)):
                loss = F.mse_loss(model(xi), yi) / 3
                loss.backward()
                want += loss.item()
            ref_opt.step()
            assert got == pytest.approx(want, rel=1e-6)
        weights = pipe.state_dict()
    assert all(p.is_meta for p in first_layers[0].parameters())  # the Pipeline took the modules' weights
    assert weights.keys() == model.state_dict().keys()  # the buffers too, named as nn.Sequential's
    for k, v in model.state_dict().items():
        torch.testing.assert_close(weights[k], v, rtol=1e-6, atol=1e-7, msg=k)


def test_mistakes_are_named():
    def layers():
        return [nn.Linear(4, 4), nn.Linear(4, 1)]

    x, y = torch.randn(4, 4), torch.randn(4, 1)
    with pytest.raises(PipelineError, match="needs a plan .* or a sample batch"):
        Pipeline(layers(), F.mse_loss)
    with pytest.raises(PlanInfeasibleError, match="128 B usable"):  # stand-ins of 128 bytes each
        Pipeline(layers(), F.mse_loss, sample=(x, y), num_microbatches=2, topology=cpu_standin(1, 128))
    with pytest.raises(PipelineError, match="layer 1 is a str"):
        Pipeline([nn.Linear(4, 4), "head"], F.mse_loss, sample=(x, y))  # pyright: ignore[reportArgumentType]
    with Pipeline(layers(), F.mse_loss, sample=(x, y), num_microbatches=2, num_stages=2) as pipe:
        with pytest.raises(PipelineError, match=r"a batch needs 4 rows .* found inputs of shape \(3, 4\)"):
            pipe.train_batch(x[:3], y[:3])
        plan = pipe.plan
    with pytest.raises(PipelineError, match="the plan cuts 2 layers but the pipeline was given 3"):
        Pipeline([*layers(), nn.Identity()], F.mse_loss, plan=plan)
    with pytest.raises(PipelineError, match=r"stage 0 \(layers 0\.\.0\) has 30 parameters"):
        Pipeline([nn.Linear(5, 5), nn.Linear(4, 1)], F.mse_loss, plan=plan)
    with Pipeline(layers(), lambda out, y: (out - y).abs(), plan=plan) as pipe:
        with pytest.raises(PipelineError, match=r"the loss function returned a torch.float32 tensor of shape \(2, 1\)"):
            pipe.train_batch(x, y)


def test_a_batch_on_a_gpu_is_refused_with_the_fix():
    """train_batch and eval_batch take host tensors: the pipeline copies each microbatch to its gpu itself, through
    pinned memory, ahead of the loads. On CUDA a batch already on a gpu failed inside the step ("cannot pin
    'torch.cuda.LongTensor'"), the last stage's rank mid-step while its peers waited; the stand-in's gpu tensors
    were taken."""
    from mobiuspipe.standin.places import on_gpu

    x, y = torch.randn(4, 4), torch.randn(4, 1)
    with Pipeline([nn.Linear(4, 4), nn.Linear(4, 1)], F.mse_loss, sample=(x, y), num_microbatches=2) as pipe:
        for bad_x, bad_y, which in ((on_gpu(x, 0), y, "inputs"), (x, on_gpu(y, 0), "targets")):
            with pytest.raises(PipelineError, match=rf"the batch's {which} are on gpu 0.*host tensors.*\.cpu\(\)"):
                pipe.train_batch(bad_x, bad_y)
            with pytest.raises(PipelineError, match=rf"the batch's {which} are on gpu 0"):
                pipe.eval_batch(bad_x, bad_y)
        assert pipe.train_batch(x, y).loss > 0  # the host batch still trains


def test_eval_waits_for_its_losses_once_not_once_a_microbatch(monkeypatch):
    """eval_batch read each microbatch's loss as it was queued (float(loss)): on CUDA a host wait a microbatch,
    the last stage's next kernels launched only after it. The losses are now read together at the end; the value is
    the same sum, in the same order."""
    torch.manual_seed(3)
    model = [nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 1)]
    x, y = torch.randn(12, 5), torch.randn(12, 1)
    with torch.no_grad():
        ref = sum(float(F.mse_loss(model[2](model[1](model[0](a))), b)) / 4 for a, b in zip(x.chunk(4), y.chunk(4)))
    reads = []
    for name in ("__float__", "item"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, _real=real, _name=name: reads.append(_name) or _real(t))
    with Pipeline(model, F.mse_loss, sample=(x, y), num_microbatches=4) as pipe:
        reads.clear()
        got = pipe.eval_batch(x, y)
        assert reads == [] and got == ref


def test_eval_leaves_every_module_as_it_found_it_and_copies_without_blocking(monkeypatch):
    """A layer whose dropout the user had turned off (eval mode) inside a training block: evaluation set every
    layer to eval and back with layer.train(mode), which sets all its submodules, so that dropout fired in every
    later training step. And the last stage copied each microbatch's targets with a blocking .to(device) (on CUDA
    from pageable memory: a host wait a microbatch)."""
    torch.manual_seed(3)
    block = nn.Sequential(nn.Linear(5, 7), nn.Dropout(0.5), nn.Tanh())
    block[1].eval()
    x, y = torch.randn(12, 5), torch.randn(12, 1)
    blocking = []
    real_to = torch.Tensor.to

    def to(t, *args, **kwargs):
        names_device = any(isinstance(a, (torch.device, str)) for a in args) or "device" in kwargs
        if names_device and not kwargs.get("non_blocking", False):
            blocking.append(args)
        return real_to(t, *args, **kwargs)

    with Pipeline([block, nn.Linear(7, 1)], F.mse_loss, sample=(x, y), num_microbatches=4) as pipe:
        layers = [layer for s in pipe.stages.values() for layer in s.layers.values()]
        modes = [m.training for layer in layers for m in layer.modules()]
        assert modes.count(False) == 1
        monkeypatch.setattr(torch.Tensor, "to", to)
        pipe.eval_batch(x, y)
        monkeypatch.undo()
        assert [m.training for layer in layers for m in layer.modules()] == modes
        assert blocking == []


def test_the_python_api_page_shows_the_example_as_it_is():
    page = (EXAMPLE.parents[1] / "docs" / "python-api.md").read_text()
    assert "```python\n" + EXAMPLE.read_text() + "```" in page, (
        "docs/python-api.md's listing differs from examples/custom_module.py: paste the file there"
    )

"""CPUAdam (C++ SIMD paths and the PyTorch fallback) against torch.optim.AdamW run in float64."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

from mobiuspipe import _ext
from mobiuspipe.optim import CPUAdam

# Tolerance, fp32 state vs a float64 reference: every element takes ~10 fp32 roundings per step (unit
# roundoff 6e-8), so a few steps stay well inside rtol 1e-6. Where the result is small because of
# cancellation (p crossing zero, m = beta1*m + (1-beta1)*g with opposite signs), the error scales with
# the operands, not the result: hence atol = 1e-6 * max|ref| of that tensor. Measured: <= 5e-7 of |ref|
# (v) and <= 3.3e-7 of max|ref| (p, m), for every path; torch.optim.AdamW in fp32 is the same.
RTOL = 1e-6
SMALL_SIZES = [1, 7, 15, 16, 17, 1023]
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
needs_c = pytest.mark.skipif(not _ext.HAVE_C, reason=f"C++ extension not built ({_ext.WHY_NOT})")


def _simd(path: str):
    have = _ext.C.simd_paths() if _ext.HAVE_C else []
    why = "C++ extension not built" if not _ext.HAVE_C else f"this CPU lacks {path} (has {have})"
    return pytest.param(("c", path), id=path, marks=pytest.mark.skipif(path not in have, reason=why))


PATHS = [_simd("scalar"), _simd("avx2"), _simd("avx512"), pytest.param(("torch", "auto"), id="fallback")]


def _close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    atol = RTOL * float(ref.abs().max())
    torch.testing.assert_close(ours.double(), ref, rtol=RTOL, atol=atol, msg=lambda m: f"{what}: {m}")


def _run(path, sizes, grad_dtype, wd, steps=3, seed=0):
    """Same params/grads through CPUAdam (two param groups) and float64 AdamW; returns both optimizers."""
    impl, simd = path
    gen = torch.Generator().manual_seed(seed)
    ours = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]
    refs = [torch.nn.Parameter(p.detach().double().clone()) for p in ours]
    half = len(sizes) // 2 or 1

    def groups(ps):
        return [{"params": ps[:half]}, {"params": ps[half:], "lr": 3e-3, "weight_decay": wd * 2, "betas": (0.8, 0.99)}]

    opt = CPUAdam(groups(ours), lr=1e-2, weight_decay=wd, impl=impl, simd=simd)
    ref = torch.optim.AdamW(groups(refs), lr=1e-2, weight_decay=wd)
    for _ in range(steps):
        grads = {}
        for p, r in zip(ours, refs):
            scale = 10 ** torch.empty(p.numel()).uniform_(-3, 1, generator=gen)
            g = (torch.randn(p.numel(), generator=gen) * scale).to(grad_dtype)
            grads[p] = g
            r.grad = g.double()
        opt.step_fused({}, grads=grads)
        ref.step()
    return opt, ours, ref, refs


def _check(opt, ours, ref, refs):
    for i, (p, r) in enumerate(zip(ours, refs)):
        _close(p.detach(), r.detach(), f"param {i} ({p.numel()})")
        for key in ("exp_avg", "exp_avg_sq"):
            _close(opt.state[p][key], ref.state[r][key], f"{key} {i}")
        assert int(opt.state[p]["step"]) == int(ref.state[r]["step"])


@pytest.mark.parametrize("wd", [0.0, 0.1], ids=["nowd", "wd"])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=["g32", "gbf16", "gfp16"])
@pytest.mark.parametrize("path", PATHS)
def test_matches_float64_adamw(path, grad_dtype, wd):
    _check(*_run(path, SMALL_SIZES, grad_dtype, wd))


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["g32", "gbf16"])
@pytest.mark.parametrize("path", PATHS)
def test_matches_float64_adamw_large(path, grad_dtype):
    """1_000_003 elements: several parallel chunks, each with a SIMD body and a scalar tail."""
    _check(*_run(path, [1_000_003], grad_dtype, 0.05, steps=2))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("path", PATHS)
def test_fused_low_precision_output(path, out_dtype):
    impl, simd = path
    gen = torch.Generator().manual_seed(1)
    ps = [torch.nn.Parameter(torch.randn(n, generator=gen) * 100) for n in (1, 17, 1023, 70_001)]
    with torch.no_grad():
        ps[1][3] = float("nan")  # NaN must stay NaN; huge values must round like torch's cast
        ps[2][5] = 3.0e38
    opt = CPUAdam(ps, lr=1e-1, impl=impl, simd=simd)
    outs = {p: torch.empty(p.shape, dtype=out_dtype) for p in ps}
    for _ in range(2):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step_fused(outs)
    for p in ps:  # bit-exact, except that any NaN encoding will do (torch's own casts differ there)
        want, got = p.detach().to(out_dtype), outs[p]
        assert torch.equal(got.isnan(), want.isnan())
        keep = ~want.isnan()
        assert torch.equal(got[keep].view(torch.int16), want[keep].view(torch.int16))


@pytest.mark.parametrize("path", PATHS)
def test_state_dict_round_trip(path):
    """Stop after 2 steps, restore into a fresh CPUAdam, 2 more: identical to 4 uninterrupted steps."""
    impl, simd = path
    gen = torch.Generator().manual_seed(2)
    init = [torch.randn(n, generator=gen) for n in (5, 33)]
    grads = [[torch.randn(t.shape, generator=gen) for t in init] for _ in range(4)]

    def run(steps, params, opt):
        for gs in steps:
            for p, g in zip(params, gs):
                p.grad = g.clone()
            opt.step()

    a = [torch.nn.Parameter(t.clone()) for t in init]
    opt_a = CPUAdam(a, lr=1e-2, impl=impl, simd=simd)
    run(grads, a, opt_a)
    b = [torch.nn.Parameter(t.clone()) for t in init]
    opt_b = CPUAdam(b, lr=1e-2, impl=impl, simd=simd)
    run(grads[:2], b, opt_b)
    sd = opt_b.state_dict()
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    c = [torch.nn.Parameter(p.detach().clone()) for p in b]
    opt_c = CPUAdam(c, lr=1.0, impl=impl, simd=simd)
    opt_c.load_state_dict(sd)
    run(grads[2:], c, opt_c)
    for x, y in zip(a, c):
        assert torch.equal(x, y)


def test_loads_a_torch_adamw_state_dict():
    """Drop-in: a checkpoint of torch.optim.AdamW continues in CPUAdam (and the reverse)."""
    p, q = torch.nn.Parameter(torch.ones(9)), torch.nn.Parameter(torch.ones(9))
    ref = torch.optim.AdamW([p], lr=1e-2)
    for _ in range(2):
        p.grad = torch.full((9,), 0.5)
        ref.step()
    with torch.no_grad():
        q.copy_(p)
    ours = CPUAdam([q], lr=1e-2)
    ours.load_state_dict(copy.deepcopy(ref.state_dict()))  # as a checkpoint: no shared tensors
    p.grad, q.grad = torch.full((9,), -0.25), torch.full((9,), -0.25)
    ref.step()
    ours.step()
    torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
    torch.optim.AdamW([p], lr=1e-2).load_state_dict(ours.state_dict())


def test_non_contiguous_and_closure_use_the_fallback():
    base = torch.randn(6, 4)
    p = torch.nn.Parameter(base.t())  # not contiguous: the PyTorch path takes it
    r = torch.nn.Parameter(base.t().double())
    opt, ref = CPUAdam([p], lr=1e-2), torch.optim.AdamW([r], lr=1e-2)

    def closure():
        opt.zero_grad()
        loss = (p**2).sum()
        loss.backward()
        return loss

    assert opt.step(closure) is not None
    r.grad = (2 * r).detach()
    ref.step()
    _close(p.detach(), r.detach(), "non-contiguous param")


def test_argument_checks():
    with pytest.raises(ValueError):
        CPUAdam([torch.nn.Parameter(torch.ones(1))], impl="gpu")
    with pytest.raises(ValueError):
        CPUAdam([torch.nn.Parameter(torch.ones(1))], betas=(1.0, 0.9))


@needs_c
def test_unknown_simd_path_is_refused():
    with pytest.raises(RuntimeError, match="not supported"):
        CPUAdam([torch.nn.Parameter(torch.ones(1))], simd="neon")


def test_missing_extension_warns_once_and_falls_back():
    code = (
        "import sys, warnings\n"
        "sys.modules['mobiuspipe._C'] = None\n"  # what a failed build looks like to the import
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    from mobiuspipe import _ext\n"
        "    from mobiuspipe.optim import CPUAdam\n"
        "    import mobiuspipe._ext\n"
        "import torch\n"
        "p = torch.nn.Parameter(torch.ones(3)); p.grad = torch.ones(3)\n"
        "CPUAdam([p]).step()\n"
        "print(_ext.HAVE_C, len([x for x in w if 'C++ extension' in str(x.message)]), float(p[0]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    have, nwarn, p0 = out.stdout.split()
    assert (have, nwarn) == ("False", "1") and float(p0) < 1.0


@pytest.mark.parametrize("path", PATHS)
def test_unaligned_views_of_a_flat_buffer(path):
    """Params and grads at odd element offsets of flat buffers (as a host pool hands them out)."""
    impl, simd = path
    sizes, offsets = [17, 1023, 40_001], [1, 19, 1045]
    flat = torch.randn(42_000, generator=torch.Generator().manual_seed(3))
    gflat = torch.randn(42_000, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    ours = [torch.nn.Parameter(flat[o : o + n]) for o, n in zip(offsets, sizes)]
    refs = [torch.nn.Parameter(p.detach().double().clone()) for p in ours]
    opt, ref = CPUAdam(ours, lr=1e-2, impl=impl, simd=simd), torch.optim.AdamW(refs, lr=1e-2)
    for _ in range(2):
        grads = {p: gflat[o + 1 : o + 1 + n] for p, o, n in zip(ours, offsets, sizes)}
        for p, r in zip(ours, refs):
            r.grad = grads[p].double()
        opt.step_fused({}, grads=grads)
        ref.step()
    _check(opt, ours, ref, refs)


def test_build_clears_a_stale_baton(tmp_path, capsys):
    """A build killed inside torch's FileBaton leaves build/ext/lock; the next build must not wait on it."""
    from mobiuspipe import _build

    (tmp_path / "lock").write_text("")
    _build._clear_stale_baton(tmp_path)
    assert not (tmp_path / "lock").exists() and "stale lock" in capsys.readouterr().err
    _build._clear_stale_baton(tmp_path)  # nothing there: nothing to do


def test_an_element_rounds_alike_in_a_vector_body_or_a_scalar_tail():
    """A flat stage buffer and per-tensor parameters must step to the same bits (the runtime's stage
    master is one flat tensor; plain training steps each tensor)."""
    from mobiuspipe.optim import CPUAdam

    g = torch.Generator().manual_seed(5)
    data, grad = torch.randn(4099, generator=g), torch.randn(4099, generator=g) * 1e-3
    flat = torch.nn.Parameter(data.clone())
    parts = [torch.nn.Parameter(x.clone()) for x in data.split([7, 1000, 17, 3075])]
    flat.grad = grad.clone()
    for p, gp in zip(parts, grad.split([7, 1000, 17, 3075])):
        p.grad = gp.clone()
    a, b = CPUAdam([flat], lr=0.01, weight_decay=0.1), CPUAdam(parts, lr=0.01, weight_decay=0.1)
    for _ in range(3):
        a.step()
        b.step()
    assert torch.equal(flat.detach(), torch.cat([p.detach() for p in parts]))

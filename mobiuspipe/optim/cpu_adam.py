"""CPUAdam: a drop-in for torch.optim.AdamW on CPU params, backed by the SIMD kernel of mobiuspipe._C."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable

import torch

from mobiuspipe import _ext

IMPLS = ("auto", "c", "torch")


def _adamw_torch(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    wd: float,
) -> None:
    """The pure-PyTorch update, the same operations as torch.optim.AdamW's single-tensor path."""
    g = g.to(p.dtype)
    p.mul_(1 - lr * wd)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    step_size = lr / (1 - beta1**step)
    bc2_sqrt = math.sqrt(1 - beta2**step)
    denom = (v.sqrt() / bc2_sqrt).add_(eps)
    p.addcdiv_(m, denom, value=-step_size)


def check_adamw_args(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """torch.optim.AdamW's argument rules: lr, eps, weight_decay >= 0 and both betas in [0, 1)."""
    if lr < 0.0 or eps < 0.0 or weight_decay < 0.0:
        raise ValueError(f"invalid lr={lr}, eps={eps} or weight_decay={weight_decay}: each must be >= 0")
    if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
        raise ValueError(f"invalid betas {betas}: each must be in [0, 1)")


def _kernel_applies(p: torch.Tensor, g: torch.Tensor, out: torch.Tensor | None) -> bool:
    return (
        _ext.HAVE_C
        and p.device.type == "cpu"
        and p.dtype == torch.float32
        and p.is_contiguous()
        and g.is_contiguous()
        and g.device.type == "cpu"
        and g.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and (out is None or out.is_contiguous())
    )


def adamw_update(
    p: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    out: torch.Tensor | None,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    *,
    impl: str = "auto",
    simd: str = "auto",
) -> None:
    """One AdamW step of p, m, v in place (step counts from 1); out, if given, receives the new p in its
    bf16/fp16 dtype. impl "auto" uses the C++ kernel where it applies, "c" requires it, "torch" never."""
    args = (step, lr, beta1, beta2, eps, weight_decay)
    if impl != "torch" and _kernel_applies(p, g, out):
        _ext.C.adamw_step(p.detach(), m, v, g, out, *args, simd=simd)
        return
    if impl == "c":
        raise RuntimeError("impl='c' needs contiguous fp32 CPU params and fp32/bf16/fp16 grads")
    with torch.no_grad():
        _adamw_torch(p, g, m, v, *args)
        if out is not None:
            out.copy_(p)


class CPUAdam(torch.optim.Optimizer):
    """AdamW (torch.optim.AdamW semantics, state keys step/exp_avg/exp_avg_sq) for CPU parameters.

    impl: "auto" uses the C++ kernel for contiguous fp32 CPU params when the extension is built, "c"
    requires it, "torch" forces the PyTorch path (env MOBIUSPIPE_ADAM_IMPL sets the default). simd:
    "auto", "avx512", "avx2" or "scalar" (env MOBIUSPIPE_ADAM_SIMD) picks the kernel's code path.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        impl: str | None = None,
        simd: str | None = None,
    ):
        check_adamw_args(lr, betas, eps, weight_decay)
        self.impl = impl or os.environ.get("MOBIUSPIPE_ADAM_IMPL", "auto")
        if self.impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, not {self.impl!r}")
        if self.impl == "c" and not _ext.HAVE_C:
            raise RuntimeError(f"impl='c' but the C++ extension is not available: {_ext.WHY_NOT}")
        self.simd = simd or os.environ.get("MOBIUSPIPE_ADAM_SIMD", "auto")
        if self.impl != "torch" and _ext.HAVE_C:
            _ext.C.resolve_simd(self.simd)  # an unsupported path fails here, not mid-step
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _update(self, group: dict, p: torch.Tensor, g: torch.Tensor, out: torch.Tensor | None) -> None:
        if g.is_sparse:
            raise RuntimeError("CPUAdam does not support sparse gradients")
        st = self._state(p)
        st["step"] += 1
        step = int(st["step"].item())
        beta1, beta2 = group["betas"]
        adamw_update(
            p,
            st["exp_avg"],
            st["exp_avg_sq"],
            g,
            out,
            step,
            group["lr"],
            beta1,
            beta2,
            group["eps"],
            group["weight_decay"],
            impl=self.impl,
            simd=self.simd,
        )

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step over every param that has a grad; returns closure() if given."""
        return self.step_fused({}, closure=closure)

    @torch.no_grad()
    def step_fused(self, low_precision_out: dict, grads: dict | None = None, closure=None):
        """step(), and for each param in low_precision_out write its updated weights into that bf16/fp16
        tensor (same shape) in the same pass over memory. grads {param: tensor} overrides p.grad, e.g. bf16
        gradients offloaded into host buffers (p.grad may also be bf16/fp16 if p.grad_dtype allows it)."""
        grads = grads or {}
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                g = grads.get(p, p.grad)
                if g is None:
                    continue
                out = low_precision_out.get(p)
                if out is not None and (out.shape != p.shape or out.dtype not in (torch.bfloat16, torch.float16)):
                    raise ValueError(f"low-precision output must be bf16/fp16 of shape {tuple(p.shape)}")
                self._update(group, p, g, out)
        return loss

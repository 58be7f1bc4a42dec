"""What one optimizer step overwrites, kept until the step is validated: the rollback of a speculative update that
puts back every bit it changed (mobiuspipe.runtime.states)."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch

__all__ = ["StepUndo"]


class StepUndo:
    """Copies of a one-parameter optimizer's state (its tensors into buffers kept from step to step, its other
    values and its param_groups' hyper-parameters as they were), of the parameter, and of other tensors the step
    writes (the device-dtype weights it emits). save() before the step; then restore() or drop()."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._saved: tuple | None = None

    @property
    def saved(self) -> bool:
        """Whether a step is kept (save() without restore() or drop() since)."""
        return self._saved is not None

    def save(
        self, optimizer: torch.optim.Optimizer | None, param: torch.Tensor | None, others: Sequence[torch.Tensor] = ()
    ) -> None:
        """Keep what the next step of optimizer over param (None: neither, only `others`) may overwrite."""
        if self._saved is not None:
            raise RuntimeError("StepUndo.save: a step is kept already: restore() or drop() it first")
        state, groups = None, None
        if optimizer is not None:
            if param is None:
                raise ValueError("StepUndo.save: an optimizer needs the parameter it steps")
            now = optimizer.state.get(param)
            state = {k: self._keep(f"state/{k}", v) for k, v in now.items()} if now else None
            groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
            self._keep("param", param.data)
        kept = [self._keep(f"other/{i}", t) for i, t in enumerate(others)]
        self._saved = (optimizer, param, state, groups, list(others), kept)

    def restore(self) -> None:
        """Put back what save() kept, bit for bit (a state the step created is removed again)."""
        if self._saved is None:
            raise RuntimeError("StepUndo.restore: nothing is kept (save() first)")
        optimizer, param, state, groups, others, kept = self._saved
        if optimizer is not None and param is not None:
            if state is None:
                optimizer.state.pop(param, None)
            else:
                _put_back(optimizer.state[param], state)
            for group, was in zip(optimizer.param_groups, groups):
                group.update(copy.deepcopy(was))
            param.data.copy_(self._buffers["param"])
        for t, k in zip(others, kept):
            t.copy_(k)
        self._saved = None

    def drop(self) -> None:
        """Forget the kept step (it was right); the buffers stay for the next save()."""
        self._saved = None

    def _keep(self, key: str, v):
        """A copy of v: a tensor into this key's buffer (made, or remade when v's shape or dtype changed)."""
        if not isinstance(v, torch.Tensor):
            return copy.deepcopy(v)
        buf = self._buffers.get(key)
        if buf is None or buf.shape != v.shape or buf.dtype != v.dtype:
            buf = self._buffers[key] = torch.empty_like(v)
        buf.copy_(v)
        return buf


def _put_back(now: dict, was: dict) -> None:
    """Set an optimizer's state dict `now` to the values in `was` (tensors copied into the state's own)."""
    for k in [k for k in now if k not in was]:
        del now[k]
    for k, v in was.items():
        if isinstance(v, torch.Tensor) and isinstance(now.get(k), torch.Tensor) and now[k].shape == v.shape:
            now[k].copy_(v)
        else:
            now[k] = v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)

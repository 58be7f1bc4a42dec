"""Whether any plan can fit the usable gpu memory G at all (a layer alone, a cut into S stages), and what to say when
none can: the figures of the memory rule (partition.rules.costmodel: W slots + gradient slot + A_j + X_j <= G) and
what G is net of (the math libraries' workspaces, the layers' buffers V a gpu keeps)."""

from __future__ import annotations

from foundation.units import GiB, fmt_bytes
from partition.errors import PlanInfeasibleError
from partition.rules.costmodel import WEIGHT_SLOTS, LayerArrays, arena_bytes
from partition.spec.profile import Profile

__all__ = ["check_layers_fit", "infeasible_stages"]


def check_layers_fit(arr: LayerArrays, profile: Profile, memory: int, buffers: int) -> None:
    """PlanInfeasibleError naming the first layer that no stage holding it can fit in `memory` (G: net of the math
    libraries' workspaces, profile.library_bytes, and of `buffers`, the layers' buffers held apart on every gpu)."""
    for l, layer in enumerate(profile.layers):
        need = _stage_need(arr, l, l)
        if need > memory and not _fits_in_some_stage(arr, l, memory):
            x = arr.transients(l, l)
            raise PlanInfeasibleError(
                f"layer {l} ({layer.name}) alone needs {fmt_bytes(need)} ({WEIGHT_SLOTS} x "
                f"{fmt_bytes(arr.params(l, l))} of arena slots for its weights and the next stage's prefetch + "
                f"{fmt_bytes(arr.grads(l, l))} for its gradients + {fmt_bytes(arr.activations(l, l))} of activations"
                + (f" + {fmt_bytes(x)} its backward holds beyond them" if x else "")
                + f") but a gpu has {fmt_bytes(memory)} usable{_net_of(profile.library_bytes, buffers)}: use a "
                "smaller microbatch, GPUs with more memory, or a smaller model"
            )


def _stage_need(arr: LayerArrays, a: int, b: int) -> int:
    """The memory rule's left side for a stage of layers a..b alone: its arena, A_j and X_j."""
    return arena_bytes(arr.params(a, b), arr.grads(a, b)) + arr.activations(a, b) + arr.transients(a, b)


def _fits_in_some_stage(arr: LayerArrays, l: int, memory: int) -> bool:
    """True when some stage a..b holding layer l meets the memory rule on its own (A_j counts only the
    stage's boundary outputs, so a layer with a large output can fit together with its neighbours)."""
    L = arr.num_layers
    return any(_stage_need(arr, a, b) <= memory for a in range(l + 1) for b in range(l, L))


def infeasible_stages(
    num_stages: int | None, arr: LayerArrays, memory: int, workspace: int, buffers: int
) -> PlanInfeasibleError:
    """The error when no cut into `num_stages` stages (None: any count) fits `memory`, net of `workspace` (W, the
    math libraries' workspaces) and `buffers` (V held apart)."""
    p = arr.params(0, arr.num_layers - 1)
    return PlanInfeasibleError(
        f"no cut of the {arr.num_layers} layers into {num_stages or 'any number of'} stages fits: the model has "
        f"{p / GiB:.2f} GiB of parameters and each stage must satisfy {WEIGHT_SLOTS} x slot + gradient slot + "
        f"activations + its layers' backward transients <= {memory / GiB:.2f} GiB{_net_of(workspace, buffers)}; "
        "use more stages (--stages), or leave --stages out to search every count"
    )


def _net_of(workspace: int, buffers: int) -> str:
    """The note that the usable memory is net of the math libraries' workspaces (Profile.library_bytes) and of the
    layers' buffers a gpu keeps (none when both are 0)."""
    parts = [f"the {workspace / GiB:.2f} GiB the math libraries' workspaces hold"] if workspace else []
    if buffers:
        parts.append(f"the {buffers / GiB:.2f} GiB of the layers' buffers (a causal mask) a gpu keeps the whole run")
    return f" (net of {' and '.join(parts)})" if parts else ""

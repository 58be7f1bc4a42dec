"""The layers a Pipeline is given: modules, or factories that build them on the ranks that need them; in host
memory, where the pipeline keeps the weights between stage visits (a layer given or built in gpu memory is taken
off the gpu)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from functools import partial

import torch
from torch import nn

from mobiuspipe.errors import PipelineError
from mobiuspipe.standin.places import gpu_of, plain

__all__ = ["LayerSpec", "factories", "build", "check_layers"]

LayerSpec = nn.Module | Callable[[], nn.Module]
"""A layer, or a factory that builds it."""


def factories(layers: nn.Sequential | Sequence[LayerSpec]) -> list[Callable[[], nn.Module]]:
    """Every layer as a factory (a module becomes a factory that returns it)."""
    if isinstance(layers, nn.Module) and not isinstance(layers, nn.Sequential):
        raise PipelineError(
            f"layers is a single {type(layers).__name__}; expected an nn.Sequential or a list of "
            f"layers (or of factories that build them): the pipeline cuts between layers"
        )
    items = list(layers)
    if not items:
        raise PipelineError("layers is empty; expected at least one layer")
    out = []
    for l, item in enumerate(items):
        if isinstance(item, nn.Module):
            _off_the_gpu(item)
            out.append(partial(_same, item))
        elif callable(item):
            out.append(partial(_made_in_host_memory, item))
        else:
            raise PipelineError(
                f"layer {l} is a {type(item).__name__}; expected an nn.Module or a zero-argument "
                f"callable that returns one"
            )
    return out


def check_layers(layers: nn.Sequential | Sequence[LayerSpec], tied: Sequence[tuple[str, str]], frozen: bool) -> None:
    """Refuse what the pipeline cannot take as it is given: a default device other than the cpu, and (unless the
    base is `frozen`, under LoRA) a shared parameter that `tied` does not name."""
    if (default := torch.get_default_device()).type != "cpu":
        raise PipelineError(
            f"torch.set_default_device({str(default)!r}) is in effect: mobiuspipe keeps the weights and optimizer "
            f"states in host memory and places on the gpu itself what it loads there, so its host buffers need the "
            f"cpu as the default; call torch.set_default_device('cpu') after building the layers"
        )
    if not frozen:  # a frozen shared parameter's copies stay equal
        _check_shared(layers, tied)


def _check_shared(layers: nn.Sequential | Sequence[LayerSpec], tied: Sequence[tuple[str, str]]) -> None:
    """Refuse a trainable parameter that two given layers share (one tensor: a tied embedding and head) unless `tied`
    names the pair: the pipeline keeps each layer's weights apart, so it would train as two parameters."""
    first: dict[int, str] = {}  # id of a parameter -> its name in the first layer that has it
    declared = {frozenset(pair) for pair in tied}
    for l, item in enumerate(layers):
        if not isinstance(item, nn.Module):
            continue  # a factory's layers are built apart
        for name, p in item.named_parameters():
            key = f"{l}.{name}"
            if not p.requires_grad or first.setdefault(id(p), key) == key:
                continue
            pair = (first[id(p)], key)
            if frozenset(pair) not in declared:
                a, b = (int(n.split(".", 1)[0]) for n in pair)
                raise PipelineError(
                    f"layers {a} and {b} share a parameter ({pair[0]} is {pair[1]}); the pipeline keeps each layer's "
                    f"weights apart, so the two would train as two parameters: give the pair as tied={[pair]} (both "
                    f"copies then update with the sum of their gradients), or give the layers apart"
                )


def _same(module: nn.Module) -> nn.Module:
    return module


def _made_in_host_memory(make: Callable[[], nn.Module]) -> nn.Module:
    layer = make()
    if isinstance(layer, nn.Module):  # anything else is refused by build, naming the layer
        _off_the_gpu(layer)
    return layer


def _off_the_gpu(layer: nn.Module) -> None:
    """Move layer's parameters and buffers that lie in gpu memory (CUDA's, or the strict stand-in's marked so) to
    host memory, shared ones staying shared, with a warning: the pipeline loads each stage into its gpu itself, and
    a copy left there would take memory no plan counts (and break the host tiers' copies)."""
    moved: dict[int, torch.Tensor] = {}
    for mod in layer.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            if _in_gpu_memory(p):
                if id(p) not in moved:
                    moved[id(p)] = nn.Parameter(_host_copy(p), p.requires_grad)
                setattr(mod, name, moved[id(p)])
        for name, b in list(mod.named_buffers(recurse=False)):
            if _in_gpu_memory(b):
                moved.setdefault(id(b), _host_copy(b))
                setattr(mod, name, moved[id(b)])
    if moved:
        warnings.warn(
            "a layer came in gpu memory: mobiuspipe moved it to host memory, where it keeps the weights between "
            "stage visits (it loads each stage into its gpu itself); build the layers on the CPU (no device=, no "
            ".cuda()) to skip the copy and leave the gpu to the plan",
            RuntimeWarning,
            stacklevel=3,
        )


def _in_gpu_memory(t: torch.Tensor) -> bool:
    return t.is_cuda or gpu_of(t) is not None


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """t's values in host memory (unmarked)."""
    return plain(t.detach()).to("cpu", copy=True) if t.is_cuda else plain(t.detach()).clone()


def build(make: Callable[[], nn.Module], l: int) -> nn.Module:
    layer = make()
    if not isinstance(layer, nn.Module):
        raise PipelineError(f"the factory of layer {l} returned a {type(layer).__name__}; expected an nn.Module")
    return layer

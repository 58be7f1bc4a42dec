"""Dynamic loss scaling for fp16 training: scale the loss up so small gradients survive fp16, skip a step whose
gradients overflowed (on any rank), halve the scale then, and double it after `growth_interval` good steps.

The same rule as torch.amp.GradScaler's defaults (init 2**16, growth 2, backoff 0.5, interval 2000), kept
as plain state so every rank and the single-process reference take the same decisions.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from mobiuspipe.errors import PipelineError

__all__ = ["LossScaler", "scaler_for"]


@dataclass
class LossScaler:
    """The current scale and how many steps in a row it has survived."""

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    good_steps: int = 0

    def __post_init__(self) -> None:
        if not (self.scale > 0 and self.growth_factor >= 1 and 0 < self.backoff_factor < 1):
            raise ValueError(
                f"LossScaler needs scale > 0, growth_factor >= 1 and 0 < backoff_factor < 1; found scale "
                f"{self.scale}, growth_factor {self.growth_factor}, backoff_factor {self.backoff_factor}"
            )
        if self.growth_interval < 1:
            raise ValueError(f"LossScaler needs growth_interval >= 1, found {self.growth_interval}")

    def state(self) -> dict:
        """Plain data of every field (a checkpoint's); load_state takes it back."""
        return asdict(self)

    def load_state(self, state: dict) -> None:
        """Take the fields state() gave (a restored checkpoint's), checked as a new scaler's are."""
        names = {f.name for f in fields(self)}
        if set(state) != names:
            raise ValueError(f"a loss scaler's state has the fields {sorted(names)}, found {sorted(state)}")
        checked = LossScaler(**state)
        for name in names:
            setattr(self, name, getattr(checked, name))

    def update(self, overflow: bool) -> None:
        """After a step: back off on an overflow (the step was skipped), grow after enough good steps."""
        if overflow:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0


def scaler_for(precision: str, given: LossScaler | None) -> LossScaler | None:
    """The loss scaler fp16 trains with; an error for a scaler given to another precision."""
    if precision == "fp16":
        return given or LossScaler()
    if given is not None:
        raise PipelineError(f"a loss_scaler was given but the precision is {precision}: only fp16 scales its loss")
    return None

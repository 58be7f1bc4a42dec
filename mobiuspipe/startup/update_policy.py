"""When each step's host updates run: at once as each stage's gradients arrive, held for the whole backward (fp16's
overflow check, clipping's norm, the serialized baseline), started tentatively although held (the speculative
update), or left to run during the next step (the delayed update); and what that keeps in host memory."""

from __future__ import annotations

from dataclasses import dataclass

from partition.rules.placement import HostCopies

__all__ = ["UpdatePolicy"]


@dataclass(frozen=True)
class UpdatePolicy:
    """A run's update settings (Pipeline's overlap_updates, delayed_update, speculative_update; checked: fp16 or
    max_grad_norm, whose checks are known only after the whole backward)."""

    checked: bool
    overlap: bool = True
    delayed_update: int | None = None
    speculative: bool = True
    accumulates: bool = False
    """Several pipeline passes a step (accumulation_steps > 1): the host tiers keep a buffer for a pass's gradients
    on their way (HostCopies.accumulates)."""

    def delayed(self, step: int) -> bool:
        """Whether optimizer step `step` computes on the weights before the update of the step before it."""
        return self.delayed_update is not None and step >= self.delayed_update

    def holds(self, step: int) -> bool:
        """Whether every update of `step` waits for its whole backward: for the checks, the serialized baseline, or
        because the next step is delayed (it starts them)."""
        return self.checked or not self.overlap or self.delayed(step + 1)

    def speculates(self, step: int, last_passed: bool = True) -> bool:
        """Whether the updates of `step`, held only for the checks, start tentatively (Stage.validate_update):
        not after a step that clipped or overflowed (last_passed False), as the next one likely does too (a rollback
        costs the update twice); speculation resumes after a step that did neither."""
        return self.speculative and self.checked and self.overlap and not self.delayed(step + 1) and last_passed

    @property
    def copies(self) -> HostCopies:
        """What each stage keeps in host memory beyond its states: the delayed update's second version; the
        speculative update's copy where some step speculates (with delayed_update N: the steps before N - 1);
        accumulation's buffer for a pass's gradients."""
        some = self.delayed_update is None or self.delayed_update >= 2
        undo = self.speculative and self.checked and some
        return HostCopies(1 if self.delayed_update is None else 2, undo, self.accumulates)

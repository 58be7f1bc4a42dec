"""Errors raised by the partition package."""

__all__ = ["PlanInfeasibleError", "UnknownModelError", "PlanFileError"]


class PlanInfeasibleError(ValueError):
    """No plan satisfies the memory rule on the given GPUs; the message carries the numbers and the fix."""


class UnknownModelError(KeyError):
    """A model name that is not in the spec table; the message lists the known names."""

    def __str__(self) -> str:  # KeyError quotes its message; show it plainly
        return str(self.args[0]) if self.args else ""


class PlanFileError(ValueError):
    """A plan file is malformed (wrong key, wrong type, inconsistent stages)."""

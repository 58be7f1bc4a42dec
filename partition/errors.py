"""Errors raised by the partition package; each is a UserError (the CLI prints it as one line, exit 2)."""

from foundation.errors import UserError
from foundation.loader import InvalidValues

__all__ = [
    "PlanInfeasibleError",
    "UnknownModelError",
    "PlanFileError",
    "InvalidPlan",
    "ProfileFileError",
    "InvalidProfile",
]


class PlanInfeasibleError(UserError, ValueError):
    """No plan satisfies the memory rule on the given GPUs; the message carries the numbers and the fix."""


class UnknownModelError(UserError, KeyError):
    """A model name that is not in the spec table; the message lists the known names."""

    def __str__(self) -> str:  # KeyError quotes its message; show it plainly
        return str(self.args[0]) if self.args else ""


class PlanFileError(UserError, ValueError):
    """A plan file is malformed (wrong key, wrong type, inconsistent stages)."""


class InvalidPlan(InvalidValues, PlanFileError):
    """A plan (or a stage of one) was made with values of the wrong type or inconsistent values."""


class ProfileFileError(UserError, ValueError):
    """A profile file is unreadable or malformed; the message names the file and the key."""


class InvalidProfile(InvalidValues, ProfileFileError):
    """A profile (or a layer of one) was made with values of the wrong type or impossible values."""

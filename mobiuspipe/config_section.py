"""The base of every run-config section: a checked frozen dataclass whose problems raise InvalidConfig."""

from __future__ import annotations

from foundation.loader import Checked
from mobiuspipe.errors import InvalidConfig

__all__ = ["Section"]


class Section(Checked):
    """A config section: its problems raise InvalidConfig, a ConfigError."""

    invalid = InvalidConfig

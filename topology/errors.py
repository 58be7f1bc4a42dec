"""Errors raised by the topology package."""

from foundation.errors import UserError

__all__ = ["TopologyError"]


class TopologyError(UserError, ValueError):
    """A topology (preset, layout file or discovery result) is malformed or unknown."""

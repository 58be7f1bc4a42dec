"""Errors raised by the topology package."""

__all__ = ["TopologyError"]


class TopologyError(ValueError):
    """A topology (preset, layout file or discovery result) is malformed or unknown."""

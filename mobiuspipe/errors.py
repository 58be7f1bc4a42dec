"""The project's exception classes: each names what was expected, what was found and the fix."""


class ConfigError(ValueError):
    """A config file or dict is unreadable, has an unknown key, a wrong type or an impossible value."""


class ArenaError(RuntimeError):
    """A stage does not fit the device arena, or the arena has no free slot."""


class PeerLostError(RuntimeError):
    """A peer rank stopped answering: it died, or it is stuck beyond the communication timeout."""


class WorldSizeError(RuntimeError):
    """The number of launched ranks differs from the plan's gpu count."""

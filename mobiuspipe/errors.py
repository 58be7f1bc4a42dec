"""The project's exception classes: each names what was expected, what was found and the fix."""

from __future__ import annotations

from pathlib import Path

from foundation.errors import UserError
from foundation.loader import InvalidValues


class ConfigError(UserError, ValueError):
    """A config file or dict is unreadable, has an unknown key, a wrong type or an impossible value."""


class InvalidConfig(InvalidValues, ConfigError):
    """A config section was made with values of the wrong type or impossible values (`problems` lists them)."""


class ArenaError(UserError, RuntimeError):
    """A stage does not fit the device arena, or the arena has no free slot."""


class PeerLostError(UserError, RuntimeError):
    """A peer rank stopped answering: it died, or it is stuck beyond the communication timeout."""


class WorldSizeError(UserError, RuntimeError):
    """The number of launched ranks differs from the plan's gpu count."""


class SwapIOError(UserError, RuntimeError):
    """A read or write of the SSD tier failed: names the file, the offset, the errno and what to do.

    errno is the OS error number (0 when the failure is not an OS error: a truncated file, a checksum
    mismatch); path and offset say where it happened.
    """

    def __init__(self, message: str, path: str = "", offset: int = -1, errno: int = 0):
        super().__init__(message)
        self.path = path
        self.offset = offset
        self.errno = errno


class StartUpError(UserError, RuntimeError):
    """A rank of the job `mobiuspipe train` launched stopped at start-up with a mistake: its message, which
    `mobiuspipe train` prints once and exits 2 with."""


class PipelineError(UserError, ValueError):
    """A Pipeline was given layers, a plan, a loss or a batch that do not fit together."""


class ExportError(UserError, RuntimeError):
    """The fine-tuned model could not be written to train.export_dir: names the rank, the file and the fix."""


class OutputError(UserError, RuntimeError):
    """A file the run writes as it goes (its records, TensorBoard's events, the final weights) could not be written:
    names the rank, the file, the errno and the fix."""

    @classmethod
    def of(cls, rank: int, path: Path, e: OSError) -> OutputError:
        """The error of rank's failed write of path."""
        return cls(
            f"rank {rank} could not write {path}: {e.strerror or e} (errno {e.errno}); free space in {path.parent}, "
            f"then run again with --resume auto"
        )

"""UserError: the base of every mistake a user can fix; the CLI and the torchrun entry print it as one line."""

__all__ = ["UserError"]


class UserError(Exception):
    """A mistake the user can fix (a bad file, value, flag or machine set-up), not a bug.

    The CLI and the torchrun entry print its message as one line and exit with code 2; any other
    exception keeps its traceback. Subclasses keep their other bases (ValueError, RuntimeError, ...).
    """

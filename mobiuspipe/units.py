"""Human-readable sizes for reports."""

__all__ = ["fmt_bytes"]


def fmt_bytes(nbytes: float) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1 (e.g. "3.38 GiB", "412.00 KiB")."""
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{int(nbytes)} B"

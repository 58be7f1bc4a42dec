"""The bottom layer every package may import: the user-error base, byte units, timing."""

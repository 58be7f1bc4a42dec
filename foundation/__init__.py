"""The bottom layer every package may import: the user-error base, the strict data loader, units, timing."""

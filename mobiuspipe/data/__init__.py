"""Tokens and batches: the run's text or token files packed into sequences, and the shipped sample texts."""

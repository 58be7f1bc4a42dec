"""Measured profiles: each layer timed on the device, a profile refined from a traced run, trace against prediction."""

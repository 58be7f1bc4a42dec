"""Models the runtime can pipeline, each given as a list of layers."""

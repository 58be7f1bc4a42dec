"""The torchrun application: a run's start-up checks, its loop's checkpoints, metrics and TensorBoard, and its usage."""

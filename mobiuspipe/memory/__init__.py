"""Where tensors live: the device arena, the host tier."""

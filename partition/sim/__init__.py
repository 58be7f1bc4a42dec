"""The step simulator: fluid flows on shared links, the stages it runs, swaps, resource bounds, retiming."""

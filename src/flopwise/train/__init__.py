"""Training: the loop, the step, the optimizer and schedule, checkpoints."""

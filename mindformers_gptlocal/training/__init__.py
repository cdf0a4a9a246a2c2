"""Training on MindFormers: train-step wrappers, optimizer, gradient checks, callbacks, metric."""

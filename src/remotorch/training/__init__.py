"""Training on the worker, client side: activation handles, parameter slots, optimizers."""

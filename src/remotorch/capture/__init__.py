"""Capture: the dynamo backend, lowering to aten, and the remote graph callables."""

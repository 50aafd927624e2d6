"""Helpers of ``benchmarks/peers.py``: the benchmarked models and the peer servers.

Every process of the benchmark (this one, the raw-socket, pyzmq and torch RPC
servers, the Ray actor) imports this package as ``_peers`` with the
``benchmarks`` folder on its path, so all of them build the same models with
the same seeded weights, and torch RPC and Ray find the same names.
"""

"""Proof that a client holds the bytes behind a content id, without sending them (protocol.md §20).

A worker with a disk cache answers "have" for ids it stored earlier, possibly
for another session or before a restart. Knowing an id is not enough to be
told: the client must prove it holds the bytes, against a nonce the worker
chose for its session. The proof is a keyed BLAKE2b over the id and
:data:`WINDOWS` windows of :data:`WINDOW` bytes at offsets drawn from the
nonce and the id (all the bytes when there are fewer than
:data:`WINDOWS` × :data:`WINDOW`). Someone who learned an id without its
bytes cannot answer; the client reads about 1 KiB per object to answer.

Both sides call :func:`proof`; the worker reads its windows from memory or
from its cache file (:class:`Bytes` over a file reads only the windows).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

WINDOWS = 16
WINDOW = 64
NONCE_BYTES = 16

Read = Callable[[int, int], bytes]  # read(offset, n) -> exactly n bytes


def windows(nonce: bytes, key: str, total: int) -> list[tuple[int, int]]:
    """The (offset, length) windows a proof covers for an object of ``total`` bytes."""
    if total <= WINDOWS * WINDOW:
        return [(0, total)] if total else []
    seed = hashlib.shake_256(b"remotorch-windows|" + nonce + b"|" + key.encode()).digest(8 * WINDOWS)
    span = total - WINDOW + 1
    return [(int.from_bytes(seed[8 * i:8 * i + 8], "little") % span, WINDOW) for i in range(WINDOWS)]


def proof(nonce: bytes, key: str, total: int, read: Read) -> bytes:
    """The 16-byte proof of holding the ``total`` bytes behind ``key``, read through ``read``."""
    h = hashlib.blake2b(key=nonce, digest_size=16, person=b"remotorch-have")
    h.update(f"{key}|{total}|".encode())
    for offset, n in windows(nonce, key, total):
        h.update(read(offset, n))
    return h.digest()


class Bytes:
    """Several buffers read as one run of bytes (a graph's document and its constants' frames)."""

    def __init__(self, parts: Sequence) -> None:
        self.parts = [memoryview(p).cast("B") for p in parts]
        self.total = sum(p.nbytes for p in self.parts)

    def read(self, offset: int, n: int) -> bytes:
        out, at = bytearray(), 0
        for p in self.parts:
            end = at + p.nbytes
            if offset < end and offset + n > at:
                lo = max(offset, at) - at
                hi = min(offset + n, end) - at
                out += p[lo:hi]
            at = end
        return bytes(out)

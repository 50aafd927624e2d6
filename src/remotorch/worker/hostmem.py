"""The worker's host memory: freed tensor buffers are kept for the next ones, as a CUDA caching
allocator keeps device memory, and given back to the system when the worker is idle.

PyTorch's CPU tensors come from the C library's ``malloc``. glibc serves a
buffer over its mmap threshold (128 KiB at first; it rises, but only up to the
size of a freed mapping) with a fresh mapping, and gives the top of its heap
back to the system as soon as more than its trim threshold is free there. A
server that makes and frees the same 1 MiB buffers over and over, as a queue of
eager calls does, then pays a page fault per 4 KiB every time: measured on a
shared 2-core virtual machine, 160 faults and 590 µs for ``y * 1.0001`` on a
1 MiB value whose buffer had just been freed, against 0 faults and 41-48 µs
with the thresholds raised. The same holds in the user's own process; a worker,
being a server, is where it is set once for everything it runs.

So a CPU worker (``remotorch serve``, unless ``--host-malloc default`` or the
environment sets glibc's own ``MALLOC_*`` tunables) keeps freed buffers of up
to :data:`MMAP_THRESHOLD` in its heap and trims the heap only when more than
:data:`TRIM_THRESHOLD` is free at its top; and, once it has been idle for
:data:`IDLE_TRIM_S` after serving, hands every free page back (``malloc_trim``),
so an idle worker holds what its sessions keep, not what they freed.

Elsewhere than glibc (musl, macOS) nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for it (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_THRESHOLD = 256 << 20
IDLE_TRIM_S = 2.0
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # malloc.h
_ENVIRONMENT = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt, libc.malloc_trim  # (glibc's; musl has neither)
    except (OSError, AttributeError):
        return None
    return libc


class HostMemory:
    """What the worker did to its host allocator (``tuned``: the thresholds were raised) and the idle
    trim (:meth:`idle`, called by the server's housekeeping thread)."""

    def __init__(self, tune: bool = True, environ=os.environ) -> None:
        self.libc = _libc()
        self.tuned = False
        self.trims = 0
        self._trimmed = True  # nothing served yet: nothing to give back
        if tune and self.libc is not None and not any(k in environ for k in _ENVIRONMENT):
            self.tuned = bool(self.libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and \
                bool(self.libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))

    def describe(self) -> str:
        if self.tuned:
            return (f"host buffers up to {MMAP_THRESHOLD >> 20} MiB kept for reuse, "
                    f"given back after {IDLE_TRIM_S:g} s idle")
        return "host allocator as the C library sets it"

    def served(self) -> None:
        """A request was served: the next idle period ends with a trim."""
        self._trimmed = False

    def idle(self, seconds: float) -> bool:
        """The worker has served nothing for ``seconds``: once per idle period past :data:`IDLE_TRIM_S`,
        give every free page back to the system; whether it did now."""
        if not self.tuned or self._trimmed or seconds < IDLE_TRIM_S:
            return False
        self._trimmed = True
        self.libc.malloc_trim(0)
        self.trims += 1
        return True

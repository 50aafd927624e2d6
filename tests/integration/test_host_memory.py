"""A CPU worker keeps freed tensor buffers for the next ones, and gives them back when idle.

Eager calls on a 1 MiB value kept on a real ``remotorch serve`` make and free
1 MiB buffers over and over. With the C library's own thresholds each new
buffer is a fresh mapping, paid for with a page fault per 4 KiB; the worker's
tuned allocator (``remotorch.worker.hostmem``) reuses them. Counted in the
worker process's own page faults (Linux's ``/proc``), which are deterministic
enough to bound: a handful against hundreds in a run of 100 calls.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

import remotorch
from remotorch.client.remote import RemoteTensor
from remotorch.worker.hostmem import IDLE_TRIM_S, HostMemory

from conftest import TOKEN, wait_until

linux = pytest.mark.skipif(not sys.platform.startswith("linux") or HostMemory().libc is None,
                           reason="glibc's allocator on Linux")


def minor_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rpartition(")")[2].split()[7])


def faults_of_a_chain(srv, windows: int = 5, calls: int = 100) -> tuple[list[int], float]:
    """(the worker's page faults in each of ``windows`` runs of ``calls`` eager calls on a kept 1 MiB
    value, the last run's result)"""
    with remotorch.Session(srv.url, token=TOKEN) as s, torch.no_grad():
        keep = remotorch.compile(lambda a: a.clone(), session=s, fallback="raise")
        y = keep(torch.ones(256, 1024))
        assert type(y) is RemoteTensor and y.is_remote
        faults = []
        for window in range(windows + 2):  # (the first two: every layout prepared, the heap warmed)
            before = minor_faults(srv.proc.pid)
            z = y
            for _ in range(calls // 2):
                z = z * 1.0001
                z = z + 0.5
            total = z.sum().item()
            if window >= 2:
                faults.append(minor_faults(srv.proc.pid) - before)
        return faults, total


@linux
def test_a_cpu_worker_reuses_freed_buffers_and_the_default_allocator_does_not(start_server):
    tuned = start_server(name="tuned")
    plain = start_server(name="plain", extra_args=("--host-malloc", "default"))
    faults, total = faults_of_a_chain(tuned)
    plain_faults, plain_total = faults_of_a_chain(plain)
    want = torch.ones(256, 1024)
    for _ in range(50):
        want = want * 1.0001 + 0.5
    assert total == plain_total == want.sum().item()
    # the median of five runs of 100 calls (a run now and then grows the heap by a fresh buffer: 256
    # faults): tuned, 2-6 measured; the C library's thresholds, a fresh mapping for many of the 1 MiB
    # buffers: 964 and 1218 measured (a single run of them went as low as 2, so only more is asserted)
    tuned_median, plain_median = sorted(faults)[2], sorted(plain_faults)[2]
    assert tuned_median < 50, faults
    assert plain_median > tuned_median, (faults, plain_faults)


@linux
def test_glibcs_own_variables_win():
    assert HostMemory(environ={}).tuned
    assert not HostMemory(environ={"MALLOC_TRIM_THRESHOLD_": "131072"}).tuned
    assert not HostMemory(environ={"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"}).tuned
    assert not HostMemory(tune=False, environ={}).tuned


@linux
def test_an_idle_worker_trims_once_per_idle_period():
    mem = HostMemory(environ={})
    assert not mem.idle(IDLE_TRIM_S * 10)  # nothing served yet
    mem.served()
    assert not mem.idle(IDLE_TRIM_S / 2)  # not idle long enough
    assert mem.idle(IDLE_TRIM_S)
    assert not mem.idle(IDLE_TRIM_S * 10)  # once per idle period
    mem.served()
    assert mem.idle(IDLE_TRIM_S) and mem.trims == 2
    untuned = HostMemory(tune=False, environ={})
    untuned.served()
    assert not untuned.idle(IDLE_TRIM_S * 10) and untuned.trims == 0


@linux
def test_an_idle_worker_gives_freed_memory_back(start_server):
    """A value of 64 MiB freed on the worker stays mapped (for reuse) while it serves, and is given
    back to the system once it has been idle: its resident set falls."""
    srv = start_server(name="trim")

    def rss() -> int:
        with open(f"/proc/{srv.proc.pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    with remotorch.Session(srv.url, token=TOKEN) as s, torch.no_grad():
        keep = remotorch.compile(lambda a: a + 1, session=s, fallback="raise")
        parts = [keep(torch.zeros(1 << 20)) for _ in range(16)]  # 16 values of 4 MiB (under 32 MiB each)
        assert all(p.is_remote for p in parts)
        assert parts[-1].sum().item() == 1 << 20
        held = rss()
        del parts
        s.echo([])  # the releases reach the worker
        assert wait_until(lambda: rss() < held - (32 << 20), timeout=IDLE_TRIM_S * 5), (held, rss())

"""Running graphs safely: under the request timeout, once more after out-of-memory, failures typed.

Every kind of run (a call, a profiled series) goes through :func:`guarded`:
without autograd, stopped at the worker's request timeout, retried once
after evicting what no session holds when it ran out of memory, and any
exception it raises becomes a typed :class:`~remotorch.errors.WorkerError`
(with the worker's traceback) so the worker keeps serving.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from typing import TypeVar

import torch

from ..errors import RemoteOutOfMemoryError, RequestTimeoutError, WorkerError
from . import quota
from .engines import call
from .deadline import DeadlineExpired, deadline
from .store import SharedStore

_T = TypeVar("_T")


def guarded(engine: str, body: Callable[[], _T], *, timeout: float | None, stores: tuple[SharedStore, ...],
            device: torch.device) -> _T:
    """Run ``body`` (graph runs) under the request timeout; out of memory evicts what no
    session holds (in ``stores``) and runs it once more; any failure becomes a typed error."""
    for attempt in range(2):
        grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)  # torch.no_grad() without its Python context manager
        try:
            if not timeout:
                return body()
            with deadline(timeout):
                return body()
        except DeadlineExpired:
            raise RequestTimeoutError(f"graph ran longer than the worker's request timeout of "
                                      f"{timeout:g}s and was stopped") from None
        except Exception as exc:
            _once_more_or_raise(exc, attempt, engine, stores, device)
        finally:
            torch._C._set_grad_enabled(grad)
    raise AssertionError("unreachable")


def _once_more_or_raise(exc: Exception, attempt: int, engine: str, stores: tuple[SharedStore, ...],
                        device: torch.device) -> None:
    """After a failed attempt: return (run it once more) when it was the first, out of memory, and
    evicting what no session holds freed something; else raise its typed error."""
    if attempt or not quota.is_out_of_memory(exc) or not quota.release_cached(stores, device):
        raise run_error(exc, engine) from None


def guarded_call(engine: str, fn: Callable, values: list, *, timeout: float | None,
                 stores: tuple[SharedStore, ...], device: torch.device) -> tuple:
    """``timed_call(fn, values)`` under :func:`guarded`, in fewer steps where it may be: on a CPU
    worker without a request timeout (an eager call's short way: ``worker/runs.py``). ``values`` is
    left as it was (each attempt hands ``fn`` a copy)."""
    if timeout or device.type != "cpu":
        return guarded(engine, lambda: timed_call(fn, list(values), device), timeout=timeout, stores=stores,
                       device=device)
    boxed = getattr(fn, "_boxed_call", False)
    grad = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)
    try:
        for attempt in range(2):  # (as guarded: out of memory evicts what no session holds, once more)
            try:
                start = time.perf_counter()
                out = fn(list(values)) if boxed else fn(*values)
                return out, (time.perf_counter() - start) * 1e3
            except Exception as exc:
                _once_more_or_raise(exc, attempt, engine, stores, device)
    finally:
        torch._C._set_grad_enabled(grad)
    raise AssertionError("unreachable")


def timed_call(fn: Callable, values: list, device: torch.device) -> tuple:
    """``fn`` on ``values`` (handed over to a boxed ``fn``, which empties the list: see
    :func:`~remotorch.worker.engines.call`) and its milliseconds (on CUDA, from a synchronized
    device to a synchronized one)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = call(fn, values)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, (time.perf_counter() - start) * 1e3


def run_error(exc: BaseException, engine: str) -> WorkerError:
    """The typed error for a graph that raised (out of memory, or anything else)."""
    tb = "".join(traceback.format_exception(exc))
    if quota.is_out_of_memory(exc):
        return RemoteOutOfMemoryError(f"out of memory running graph: {type(exc).__name__}: {exc}",
                                      remote_traceback=tb)
    return WorkerError(f"graph failed on {engine}: {type(exc).__name__}: {exc}", remote_traceback=tb)

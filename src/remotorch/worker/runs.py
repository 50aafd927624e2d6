"""A ``Run``'s reply, and a ``Runs`` message: eager calls the client queued together (protocol.md §18.4).

One request runs one graph (``Run``) or several in order (``Runs``); both
answer each run the same way (:func:`run_reply`). A run of a ``Runs`` that
fails is answered with its ``ErrorReply``, and the runs after it still run
(each fails on its own if it needs what the failed one was to make), as they
would have as requests of their own.

Such an eager call is a brief run whose outputs are all kept as planned;
:func:`run_kept` runs it the short way.
"""

from __future__ import annotations

import logging
import traceback

import torch

from ..codec import messages as m
from ..codec.frames import FrameWriter
from ..errors import InvalidRequestError, MissingObjectsError, RemoteError, RemoteOutOfMemoryError, WorkerError
from .calls import Ran
from .guard import guarded_call
from .outputs import Echo, OutputPlan, dispose

log = logging.getLogger(__name__)

_WIRE = (m.HandleArg, m.KeptArg, m.ScalarArg)  # outputs the worker disposed of (the rest travel inline)
_KEPT = m.ScalarArg(None)  # a brief run's output kept as planned (left unsaid in its reply)


def short(req: m.Run) -> bool:
    """Whether a brief run has none of the parts :func:`run_kept` leaves to the general way."""
    return not (req.saved_from >= 0 or req.keep_min_bytes or req.strides or req.echo or req.grad_slots or req.send
                or req.take or req.keep_inputs or req.bind or req.bound or req.cuda_graphs or req.rng)


def run_kept(worker, session: object, req: m.Run, send) -> Ran | float | None:
    """``worker.run`` the short way, for a brief run whose outputs are kept, row-major, as planned: an
    eager call queued without waiting (``client/prepared.py``), a loop of which is a worker's whole load
    then. It prepares the run as the general way does (the graph, its engine, the arguments, checked),
    runs it under the same guard, and stores its outputs as the handles named, in fewer steps than the
    general output plan. What it returns:

    * its milliseconds alone (a float) when every output was kept as planned and nothing compiled:
      the reply says nothing of it (:func:`serve_runs`; :meth:`Worker.run` makes it a :class:`Ran`);
    * a :class:`Ran` when outputs not kept as planned (not row-major, not tensors, over the quota)
      went through the general disposal, or the run compiled its graph;
    * None (nothing run) for a random graph, which the general way runs from the session's generator.
    """
    prep = worker._prepare(session, req.graph_id, req.engine, req.args, ())
    if prep.random:
        return None
    out, ms = guarded_call(req.engine, prep.fn, prep.values, timeout=worker.limits.request_timeout,
                           stores=worker.stores, device=worker.device)
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    keep, n = req.keep, len(outs)
    if len(keep) == n and all(k == i for i, k in enumerate(keep)) and \
            all(type(o) is torch.Tensor and o.is_contiguous() and all(d > 1 for d in o.shape) for o in outs) \
            and worker.may_keep(session, sum(o.numel() * o.element_size() for o in outs)):
        worker.handles.put(session, list(range(req.handle_base, req.handle_base + n)), outs)
        return Ran([_KEPT] * n, ms, True) if prep.compiled else ms
    return Ran(dispose(worker, session, OutputPlan.of(req), outs, frozenset(), {}, send), ms, prep.compiled)


def error_of(exc: RemoteError) -> m.ErrorReply:
    """A typed failure as a reply (missing objects listed, for the client to re-upload)."""
    if isinstance(exc, MissingObjectsError):
        return m.ErrorReply(exc.kind, exc.message, exc.remote_traceback, exc.graphs, exc.tensors,
                            exc.handles, exc.slots, exc.optims, exc.bindings)
    return m.ErrorReply(exc.kind, exc.message, exc.remote_traceback)


def _answer(o, w: FrameWriter):
    """An output that travels in the reply: kept and echoed, a tensor inline, or a scalar."""
    return m.EchoArg(o.id, w.meta(o.tensor)) if type(o) is Echo else w.value(o)


def run_reply(ran, brief: bool, w: FrameWriter) -> m.RunReply:
    """The reply to a run: a brief run's says only what the client does not know (values, and
    outputs not disposed of as planned); another's names every output."""
    if brief:
        at = [i for i, o in enumerate(ran.outputs) if not isinstance(o, _WIRE) and o is not None]
        return m.RunReply([_answer(ran.outputs[i], w) for i in at], ran.ms, ran.compiled, at, ran.rng or [])
    outputs = [o if isinstance(o, _WIRE) else _answer(o, w) for o in ran.outputs]
    return m.RunReply(outputs, ran.ms, ran.compiled, rng=ran.rng or [])


def serve_runs(worker, session, req: m.Runs, frames: list, send) -> tuple[m.RunsReply, list]:
    """Run each of ``req.runs`` in order (see the module docstring); the reply and its frames."""
    n = len(req.runs)
    counts = req.frames or [0] * n
    if len(counts) != n or any(c < 0 for c in counts) or sum(counts) != len(frames) \
            or len(req.housekeeping) not in (0, n):
        raise InvalidRequestError("a runs message must give each run its frames and housekeeping")
    w, ms, said, start = FrameWriter(), [], {}, 0
    housekeeping, shortway = req.housekeeping, not worker.cuda_graphs
    for i, run in enumerate(req.runs):
        own = frames[start:start + counts[i]]
        start += counts[i]
        try:
            if housekeeping and housekeeping[i] is not None:
                worker.apply_pending(session, housekeeping[i])
            ran = run_kept(worker, session, run, send) if shortway and run.brief and not own and short(run) \
                else None
            if ran is None:
                ran = worker.run(session, run, own, send)
            elif type(ran) is float:  # every output kept as planned: nothing to say
                ms.append(ran)
                continue
        except RemoteError as exc:
            ms.append(0.0)
            said[i] = error_of(exc)
            continue
        except MemoryError as exc:
            ms.append(0.0)
            said[i] = error_of(RemoteOutOfMemoryError(f"worker out of host memory: {exc}"))
            continue
        except Exception as exc:  # a bug of ours must still be an answer
            log.exception("unexpected error while running one of several runs")
            ms.append(0.0)
            said[i] = error_of(WorkerError(f"{type(exc).__name__}: {exc}", remote_traceback=traceback.format_exc()))
            continue
        ms.append(ran.ms)
        reply = run_reply(ran, run.brief, w)
        if reply.outputs or reply.compiled or reply.rng or not run.brief:
            said[i] = reply
    return m.RunsReply(ms, said), w.frames

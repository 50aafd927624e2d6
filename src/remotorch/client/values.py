"""Values that stay on a worker, from the connection's side: how they travel, and how they outlive a session.

* :func:`value_arg`: a placeholder as an argument of a request to its own
  worker (its handle, or a view of it), or to another worker (the copy
  :func:`import_values` moved there first, worker to worker under a ticket).
* :func:`unpack`: a reply's outputs, kept ones as placeholders (a run sent
  without waiting makes its placeholders itself: :mod:`remotorch.client.launch`).
* :func:`fetch_many`: tensors of handles, in one ``Fetch``.
* :func:`fetch_held`: before a session ends, every value Python still holds
  is fetched, so none becomes unreadable.
* :class:`Recompute`: with ``fallback="local"``, how a value is remade here if
  its worker is lost.

The placeholder itself (:class:`~remotorch.client.remote.RemoteTensor`) is in
:mod:`remotorch.client.remote`.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from itertools import compress
from typing import Protocol

import torch

from .. import errors
from ..codec import messages as m
from ..codec.frames import FrameReader, FrameWriter
from ..codec.tensors import dtype_name
from .placeholders import fill, placeholder
from .remote import REMOTE, RemoteTensor, Tensor, arg_of, plain, remote_ref
from .graph import Graph

_IS_REMOTE = REMOTE.__contains__

log = logging.getLogger(__name__)


class Connection(Protocol):
    """What these functions use of a connection (:class:`remotorch.client.connection.Connection`)."""

    lock: object
    link: object
    handles: object
    stats: object
    reuse: object
    policies: object

    def request(self, body, frames=(), progress=None, expect=None, pending=None): ...

    def fetch_many(self, args) -> list[torch.Tensor]: ...

    def run(self, graph, args, **kwargs): ...


def value_arg(conn: Connection, t: RemoteTensor, w: FrameWriter):
    """A placeholder as an argument here: its handle (or view), a copy moved here, or its data."""
    ref = remote_ref(t)
    if ref is not None and not ref.handle:  # a value its call's reply brings: wait for it (a read)
        ref.check()
        ref = remote_ref(t)
    if ref is None:
        return w.value(plain(t))  # fetched already: an ordinary tensor
    if ref.launched is not None and (ref.launched.done or ref.conn is not conn):
        ref.check()  # the call that makes it failed: say so, not "missing handle"
    if ref.conn is conn:
        return arg_of(t)
    copy = ref.copies.get((id(conn), _view_key(t)))
    if copy is None:
        raise errors.ProtocolError("a value of another worker was not moved here first")
    return m.HandleArg(copy[1])


def import_values(conn: Connection, args: Sequence) -> None:
    """Move values that other workers keep, among ``args``, to this worker (worker to worker).

    Call before the request that uses them, without holding this
    connection's lock: each transfer takes the two connections' locks one
    after the other, never together.
    """
    for t in compress(args, map(_IS_REMOTE, map(type, args))):  # (the placeholders, filtered in C)
        ref = remote_ref(t)
        if ref is not None and not ref.handle:  # its call's reply brings it here: nothing to move
            continue
        if ref is None or ref.conn is conn or (id(conn), _view_key(t)) in ref.copies:
            continue
        if conn.link.transport is not None and not conn.link.url:
            raise errors.WorkerUnavailableError("this worker has no address another worker can reach")
        arg = arg_of(t)
        hid = conn.handles.reserve(1)
        ticket, _ = conn.request(m.ExpectHandles([hid], [m.TensorMeta(dtype_name(t.dtype), list(t.shape),
                                                                          list(t.stride()), 0)]),
                                 expect=m.TicketReply)
        conn.handles.seen(hid)  # from now on the worker may hold it: released with the placeholder
        if type(ref.copies) is not dict:
            ref.copies = {}
        ref.copies[(id(conn), _view_key(t))] = (conn, hid)
        ref.conn.request(m.SendHandles([arg], conn.link.url or "", ticket.ticket_id, ticket.secret),
                         expect=m.Ok)
        conn.stats.values_moved += 1


def fetch_many(conn: Connection, args: Sequence[m.HandleArg | m.ViewArg]) -> list[torch.Tensor]:
    """The tensors of several handles (or views), in one request; they stay on the worker."""
    with conn.lock:
        reply, frames = conn.request(m.Fetch(list(args)), expect=m.FetchReply)
        if len(reply.values) != len(args):
            raise errors.ProtocolError("worker answered a fetch with the wrong number of values")
        conn.stats.values_fetched += len(args)
    reader = FrameReader(frames)
    return [reader.tensor(meta) for meta in reply.values]


def unpack(conn: Connection, graph: Graph, outputs: list, frames: list) -> list:
    """A reply's outputs: tensors sent back, on the devices the graph's outputs live on; kept
    ones as placeholders (``RemoteTensor``) standing for their handles here."""
    if len(outputs) != len(graph.output_devices):
        raise errors.ProtocolError("worker returned the wrong number of outputs")
    reader, out = FrameReader(frames), []
    for i, (arg, device) in enumerate(zip(outputs, graph.output_devices)):
        if type(arg) is m.KeptArg:
            conn.handles.seen(arg.id)
            out.append(placeholder(conn, arg, device, conn.policies.of(graph), i))
            continue
        value = reader.value(arg, device)
        conn.reuse.returned(graph, i, value)
        out.append(value)
    return out


def unpack_outputs(graph: Graph, outputs: list, frames: list) -> list:
    """A reply's outputs as values on the devices the graph's outputs live on (nothing kept)."""
    if len(outputs) != len(graph.output_devices):
        raise errors.ProtocolError("worker returned the wrong number of outputs")
    reader = FrameReader(frames)
    return [reader.value(arg, device) for arg, device in zip(outputs, graph.output_devices)]


def _view_key(t: RemoteTensor):
    view = t.__dict__.get("_rt_view")
    return None if view is None else (tuple(view[0]), tuple(view[1]), view[2])


# ------------------------------------------------------------------ lifetime
def fetch_held(conn: Connection, batch_bytes: int = 1 << 30, batch_count: int = 4096) -> int:
    """Fetch every value this connection's worker still keeps for placeholders Python holds.

    Before a session ends: from then on they are ordinary tensors here and
    never become unreadable. One ``Fetch`` per batch (up to ``batch_count``
    values or ``batch_bytes``); a batch the worker cannot answer whole (a
    value it lost) is retried one value at a time, and what still fails stays
    a placeholder that raises its typed error when read. Returns how many
    values were fetched.
    """
    todo = []
    for ref in conn.handles.values():
        t = ref.root() if ref.root is not None else None
        if t is None or t.__dict__.get("_rt_ref") is not ref or ref.stays:
            continue
        try:
            ref.check()  # an asynchronous call still making it: wait for it (and skip it if it failed)
        except errors.RemoteError:
            continue
        todo.append(t)
    if not todo:
        return 0
    log.debug("fetching %d value(s) from %r before the session ends", len(todo), conn)
    done, batch, size = 0, [], 0
    for t in todo:
        batch.append(t)
        size += t.nbytes
        if len(batch) >= batch_count or size >= batch_bytes:
            done += _fetch_into(conn, batch)
            batch, size = [], 0
    return done + (_fetch_into(conn, batch) if batch else 0)


def fetch_placeholders(tensors) -> int:
    """Bring here the values of these placeholders that are still on a worker: one ``Fetch`` per
    worker for whole values, one each for views. Returns how many were fetched."""
    by_conn: dict[int, tuple] = {}
    done = 0
    for t in tensors:
        ref = remote_ref(t)
        if ref is None:
            continue
        if "_rt_view" in t.__dict__ or not ref.handle or ref.launched is not None:
            t.materialize_()
            done += 1
        else:
            by_conn.setdefault(id(ref.conn), (ref.conn, []))[1].append(t)
    for conn, batch in by_conn.values():
        with conn.lock:
            values = conn.fetch_many([m.HandleArg(t.__dict__["_rt_ref"].handle) for t in batch])
        for t, value in zip(batch, values):
            fill(t, value)
        done += len(batch)
    return done


def _fetch_into(conn: Connection, placeholders: list) -> int:
    try:
        values = conn.fetch_many([m.HandleArg(t.__dict__["_rt_ref"].handle) for t in placeholders])
    except errors.RemoteError as exc:
        if len(placeholders) == 1 or isinstance(exc, (errors.TransportError, errors.WorkerUnavailableError)):
            log.warning("%d value(s) on %r could not be fetched before the session ended: %s",
                        len(placeholders), conn, exc)
            return 0
        return sum(_fetch_into(conn, [t]) for t in placeholders)
    for t, value in zip(placeholders, values):
        fill(t, value)
    return len(placeholders)


class Recompute:
    """Run a graph here from the inputs of one remote call, for the outputs it kept on a worker.

    Holds the inputs weakly with their version counters: a value is remade
    only from the very tensors it was made from, unchanged. The graph runs
    at most once for all outputs of the call.
    """

    __slots__ = ("graph", "inputs", "outputs")

    def __init__(self, graph, args) -> None:
        self.graph = weakref.ref(graph)
        self.inputs = [(weakref.ref(a), a._version) if isinstance(a, Tensor) else (a, None) for a in args]
        self.outputs: list | None = None

    def value(self, index: int, error: Exception) -> Tensor:
        """Output ``index``, made here; ``error`` (the failed fetch's) when it cannot be."""
        if self.outputs is None:
            graph, args = self.graph(), []
            for a, version in self.inputs:
                t = a() if version is not None else a
                if graph is None or (version is not None and (t is None or t._version != version)):
                    raise error  # an input died or changed since: its value cannot be remade
                args.append(t)
            self.outputs = graph.run_locally(args, error)
        return self.outputs[index]


def recompute_locally(graph, args, outputs) -> None:
    """Let the outputs of this call that stay on a worker be remade here if that worker is lost."""
    rc = None
    for o in outputs:
        ref = remote_ref(o)
        if ref is not None:
            rc = rc or Recompute(graph, args)
            ref.recompute = rc

"""Client side of training: graphs run with worker-resident activations, parameters and gradients.

A :class:`TrainingClient` belongs to one :class:`~remotorch.session.Session`
(:func:`training_client` makes it on first use) and adds to it:

* forward graphs whose saved-for-backward outputs stay on the worker as
  handles (local placeholders from :mod:`remotorch.handles`);
* trainable parameters held in worker slots (:mod:`remotorch.params`), so
  that backward graphs accumulate parameter gradients there and a worker-side
  optimizer (:mod:`remotorch.optim`) updates them in place;
* :meth:`TrainingClient.pull`, which brings the worker's values back.

Releases of freed handles and slots, and ``zero_grad()``, ride on the next
training request (:class:`~remotorch.codec.messages.Pending`). It uses
the session's own request path and upload cache (``_request``,
``_ensure_graph``, ``_remember``, ``_upload_tensors``) and its lock.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import msgspec
import torch

from .. import errors
from ..codec import messages as m
from ..codec.tensors import tensor_from_wire, tensor_to_wire
from ..codec.values import arg_to_value
from .handles import ForwardCall, HandleTable, call_of, handle_of
from .params import ParamSlots, Slot, owner_of

if TYPE_CHECKING:
    from ..capture.graph import RemoteGraph
    from ..client.session import Session

log = logging.getLogger(__name__)

_UNRECOVERABLE = ("handle:", "slot:", "optim:")


def training_client(session: Session) -> TrainingClient:
    """The session's training state, created on first use."""
    client = getattr(session, "_training_client", None)
    if client is None:
        with session._lock:
            client = getattr(session, "_training_client", None)
            if client is None:
                client = session._training_client = TrainingClient(session)
    return client


def keeps_state(session: object) -> bool:
    """True for a :class:`~remotorch.session.Session`, whose worker can keep training state.

    Other objects stand where a session would (a profiler runs graphs on
    several workers); their graphs run as plain calls.
    """
    from ..client.session import Session
    return isinstance(session, Session)


def has_slots(session: Session) -> bool:
    """True when some parameter of this session lives in a worker slot."""
    client = getattr(session, "_training_client", None)
    return client is not None and client.slots.bound


class TrainingClient:
    """Handles, parameter slots and optimizer ids of one session."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.handles = HandleTable()
        self.slots = ParamSlots(session)
        self._next_optim = 1
        self._dropped_optims: list[int] = []
        self._zero_grad: list[int] = []
        self._superseded: list[str] = []

    # ----------------------------------------------------------------- releases
    def new_optim_id(self) -> int:
        oid, self._next_optim = self._next_optim, self._next_optim + 1
        return oid

    def drop_optim(self, oid: int) -> None:
        self._dropped_optims.append(oid)
        self.slots.forget_optim(oid)

    def defer_zero_grad(self, oid: int) -> None:
        """Clear an optimizer's gradients (to None) before the next training request runs."""
        if oid not in self._zero_grad:
            self._zero_grad.append(oid)

    def take_pending(self) -> m.Pending | None:
        """Deferred housekeeping to piggy-back on the next training request (None: nothing)."""
        handles, slots = self.handles.take_released(), self.slots.take_dropped()
        optims, self._dropped_optims = self._dropped_optims, []
        zero, self._zero_grad = self._zero_grad, []
        superseded, self._superseded = self._superseded, []
        if not (handles or slots or optims or zero or superseded):
            return None
        return m.Pending(handles, slots, optims, zero, superseded)

    def request(self, body, frames: Sequence = ()):
        """Send a training request with the deferred housekeeping riding on it."""
        pending = self.take_pending()
        if pending is not None:
            body = msgspec.structs.replace(body, pending=pending)
        return self.session._request(body, frames)

    def flush(self) -> None:
        """Send deferred housekeeping now (normally it waits for the next training request)."""
        with self.session._lock:
            pending = self.take_pending()
            if pending is not None:
                self.session._request(pending)

    # -------------------------------------------------------------------- slots
    def claim(self, t: torch.Tensor) -> Slot:
        """This session's slot for a parameter; ForeignParameterError if another session holds it."""
        other = owner_of(t)
        if other is not None and other is not self.session and not other._closed:
            theirs = getattr(other, "_training_client", None)
            if theirs is not None and theirs.slots.lookup(t) is not None:
                raise errors.ForeignParameterError(
                    f"parameter of shape {list(t.shape)} is held by another session's worker; "
                    "use that session (or pull it and close that session first)")
        return self.slots.get_or_new(t)

    def bind_stale(self, tensors: Iterable[torch.Tensor]) -> None:
        """Upload local values into the slots whose local copy moved (or that are new)."""
        s = self.session
        todo = []
        for t in tensors:
            slot = self.claim(t)
            if self.slots.stale(slot, t) and all(slot is not d[1] for d in todo):
                todo.append((t, slot))
        if not todo:
            return
        values, frames = [], []
        for t, _ in todo:
            tid = self._known_content(t)
            if tid is not None:
                values.append(m.RefArg(tid))
            else:
                meta, buf = tensor_to_wire(t, len(frames))
                values.append(m.TensorArg(meta))
                frames.append(buf)
        versions = [t._version for t, _ in todo]
        self.request(m.BindSlots([slot.sid for _, slot in todo], values), frames)
        for (_, slot), version in zip(todo, versions):
            slot.version = version
            slot.stepped = False
        self.slots.bound = True
        s._stats["tensors_uploaded"] += len(frames)

    def _known_content(self, t: torch.Tensor) -> str | None:
        """The content id the worker already holds for this exact local value, if any."""
        entry = self.session._resident.get(id(t))
        if entry is not None and entry[0]() is t and entry[1] == t._version \
                and entry[2] in self.session._tensors_on_worker:
            return entry[2]
        return None

    def push_local_grads(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Move gradients autograd left on local parameters into their slots' gradients.

        They appear where a gradient did not come from a remote backward graph
        (a parameter used by local code between graph breaks, or a backward
        graph that saved nothing to route them by). Returns those parameters.
        """
        todo = [p for p in params if p.grad is not None]
        if not todo:
            return todo
        self.bind_stale(todo)
        metas, frames = [], []
        for p in todo:
            meta, buf = tensor_to_wire(p.grad, len(frames))
            metas.append(meta)
            frames.append(buf)
        self.request(m.AccumulateGrads([self.slots.lookup(p).sid for p in todo], metas), frames)
        for p in todo:
            p.grad = None
        return todo

    # ---------------------------------------------------------------------- run
    def run(self, graph: RemoteGraph, args: Sequence) -> list:
        """Run a graph with resident state; saved outputs of a forward come back as placeholders."""
        s = self.session
        with s._lock:
            for attempt in range(2):
                try:
                    s._ensure_graph(graph)
                    req, frames, call = self._pack(graph, args)
                    reply, out_frames = self.request(req, frames)
                    break
                except errors.MissingObjectsError as exc:
                    if attempt or any(str(i).startswith(_UNRECOVERABLE) for i in exc.tensors):
                        raise
                    s._graphs_on_worker.difference_update(exc.graphs)
                    s._tensors_on_worker.difference_update(exc.tensors)
            s._stats["remote_calls"] += 1
            s._stats["remote_ms"] += reply.run_ms
            return self._unpack(graph, reply, out_frames, call)

    def _pack(self, graph: RemoteGraph, args: Sequence) -> tuple[m.RunResident, list, ForwardCall]:
        call = ForwardCall(len(args))
        resident = set(graph.resident)
        slotted = {i for i in graph.resident if self._wants_slot(graph, args[i])}
        self.bind_stale([args[i] for i in graph.resident if i in slotted])
        plain = [i for i in graph.resident if i not in slotted]
        refs = dict(zip(plain, self._content_ids([args[i] for i in plain])))
        run_args, frames = [], []
        backward_of: ForwardCall | None = None
        for i, a in enumerate(args):
            hid = handle_of(a)
            if hid is not None:
                run_args.append(m.HandleArg(hid))
                if backward_of is None:
                    backward_of = call_of(a)
            elif i in refs:
                run_args.append(m.RefArg(refs[i]))
            elif i in resident:
                slot = self.slots.lookup(a)
                if slot.optims:  # its optimizer is on the worker: so are its gradients
                    call.slots[i] = slot.sid
                    call.params[i] = a
                run_args.append(m.SlotArg(slot.sid))
            elif isinstance(a, torch.Tensor):
                meta, buf = tensor_to_wire(a, len(frames))
                run_args.append(m.TensorArg(meta))
                frames.append(buf)
            else:
                run_args.append(m.ScalarArg(_scalar(a)))
        keep_from, base = -1, 0
        if graph.saved_from is not None:
            keep_from = graph.saved_from
            base = self.handles.reserve(sum(d is not None for d in graph.output_devices[keep_from:]))
        grads = []
        if backward_of is not None and backward_of.n_inputs == len(graph.output_devices):
            grads = [[i, sid] for i, sid in backward_of.slots.items()
                     if accumulated_by_this_backward(backward_of.params[i])]
        req = m.RunResident(graph.graph_id, graph.engine, run_args, keep_from, base, grads)
        return req, frames, call

    def _content_ids(self, tensors: list) -> list[str]:
        """The session's content ids for resident tensors that do not train (buffers, frozen weights).

        A training forward typically updates buffers (batch norm statistics):
        the new value gets a new id and is uploaded, and the superseded one is
        released on the worker, or it would hold one copy per step.
        """
        s = self.session
        ids, before, uploads = [], [], []
        for t in tensors:
            entry = s._resident.get(id(t))
            same = entry is not None and entry[0]() is t
            before.append(entry[2] if same else None)
            if not same or entry[1] != t._version:
                entry = s._remember(t)
            tid = entry[2]
            if tid not in s._tensors_on_worker and all(tid != u[0] for u in uploads):
                uploads.append((tid, t))
            ids.append(tid)
        if uploads:
            s._upload_tensors(uploads)
        live = set(ids)
        for old in before:
            if old is not None and old not in live and old in s._tensors_on_worker:
                s._tensors_on_worker.discard(old)
                self._superseded.append(old)
        return ids

    def _wants_slot(self, graph: RemoteGraph, t) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        if graph.saved_from is not None and t.requires_grad:
            return True  # a trainable parameter of a training forward
        return self.slots.lookup(t) is not None

    def _unpack(self, graph: RemoteGraph, reply, frames: list, call: ForwardCall) -> list:
        if not isinstance(reply, m.ResidentReply) or len(reply.outputs) != len(graph.output_devices):
            raise errors.ProtocolError("worker answered a training run with the wrong reply")
        outs = []
        for arg, device in zip(reply.outputs, graph.output_devices):
            if isinstance(arg, m.HandleArg):
                outs.append(self.handles.placeholder(arg.id, call))
                self.handles.seen(arg.id)
            else:
                outs.append(arg_to_value(arg, frames, device))
        return outs

    # --------------------------------------------------------------------- pull
    def pull(self, module: torch.nn.Module, grads: bool = False) -> int:
        """Copy slot values (and gradients) from the worker into ``module``; returns how many."""
        tensors = [t for _, t in module.named_parameters()] + [t for _, t in module.named_buffers()]
        return self.pull_tensors(tensors, grads)

    def refresh_local(self, tensors: Sequence) -> int:
        """Bring back the values an optimizer changed on the worker, for a graph that runs here.

        A graph that cannot run remotely runs locally with the local copies
        of the parameters; those of its parameters stepped on the worker are
        pulled first (only those: the others are current). Returns how many.
        """
        stepped = []
        for t in tensors:
            slot = self.slots.lookup(t) if isinstance(t, torch.Tensor) else None
            if slot is not None and slot.stepped and not self.slots.stale(slot, t):
                stepped.append(t)
        return self.pull_tensors(stepped) if stepped else 0

    def pull_tensors(self, tensors: Sequence[torch.Tensor], grads: bool = False) -> int:
        """Copy slot values (and gradients) from the worker into these local tensors."""
        s = self.session
        with s._lock:
            pairs = [(t, self.slots.lookup(t)) for t in tensors]
            pairs = [(t, slot) for t, slot in pairs if slot is not None and slot.version >= 0]
            if not pairs:
                return 0
            self.bind_stale([t for t, _ in pairs])  # a local change made since wins, as on a call
            reply, frames = self.request(m.PullSlots([slot.sid for _, slot in pairs], grads))
            if not isinstance(reply, m.PullReply) or len(reply.values) != len(pairs):
                raise errors.ProtocolError("worker answered a pull with the wrong reply")
            for (t, slot), meta in zip(pairs, reply.values):
                with torch.no_grad():
                    t.copy_(tensor_from_wire(meta, frames[meta.frame]))
                slot.version = t._version
                slot.stepped = False
            for (t, slot), meta in zip(pairs, reply.grads if grads else []):
                if slot.optims:  # other gradients live in p.grad already
                    t.grad = None if meta is None else tensor_from_wire(meta, frames[meta.frame]).clone().to(t.device)
        return len(pairs)


def accumulated_by_this_backward(t: torch.Tensor) -> bool:
    """True when the running backward pass accumulates into ``t.grad``.

    So it does in ``loss.backward()`` (and for ``t`` among ``backward(inputs=…)``);
    then the gradient may stay on the worker. Under ``torch.autograd.grad`` the
    engine captures the gradient instead (and refuses to answer for a leaf),
    so it must come back to the caller.
    """
    try:
        with torch.enable_grad():
            node = t.view_as(t).grad_fn.next_functions[0][0]  # t's AccumulateGrad node
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:
        return False  # "a leaf node was passed ... while running autograd.grad()"
    except (AttributeError, IndexError):
        return True


def _scalar(a):
    if a is None or isinstance(a, (bool, int, float)):
        return a
    raise errors.UnsupportedGraphError(f"argument of type {type(a).__name__} cannot travel")

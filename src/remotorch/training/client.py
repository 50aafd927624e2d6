"""Client side of training: graphs run with activations, parameters and gradients kept on the worker.

A :class:`TrainingClient` belongs to one :class:`~remotorch.client.connection.Connection`
(one worker; a session makes one for its first worker on first need, a
pipeline one per stage worker) and adds to it:

* forward graphs whose saved-for-backward outputs stay on the worker as
  handles (local placeholders from :mod:`remotorch.training.handles`);
* trainable parameters held in worker slots (:mod:`remotorch.training.params`),
  so that backward graphs accumulate parameter gradients there and a
  worker-side optimizer (:mod:`remotorch.training.optim`) updates them in place;
* :meth:`TrainingClient.pull`, which brings the worker's values back.

Releases of freed handles and slots, and ``zero_grad()``, ride on the next
training request (:class:`~remotorch.codec.messages.Pending`, on the
envelope). Runs go through :meth:`Connection.run` like every other run,
with this client's hook placing slots, activations and buffers.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable, Sequence

import torch

from .. import errors
from ..client.connection import Connection, Graph
from ..client.ids import stamp
from ..client import origin
from ..client.launch import Plan, launch, launchable, nbytes
from ..client.placeholders import placeholder
from ..client.remote import REMOTE, RemoteGrad, remote_ref
from ..client.values import value_arg
from ..client.launched import Launched
from ..client.session import Session
from ..codec import messages as m
from ..codec.frames import FrameReader, FrameWriter
from ..codec.tensors import contiguous_strides, dtype_name, is_permuted_contiguous
from .handles import ForwardCall, call_of, handle_of
from .handles import placeholder as activation
from .params import ParamSlots, Slot, owner_of, waiting_optimizers

log = logging.getLogger(__name__)


def training_client(session: Session) -> TrainingClient:
    """The training client of a session's first worker, created on first use."""
    return session.trainer()


class TrainingClient:
    """Handles, parameter slots and optimizer ids of one worker-side session (one connection)."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self.handles = connection.handles
        self.slots = ParamSlots(self)
        self._next_optim = 1
        self._dropped_optims: list[int] = []
        self._zero_grad: list[int] = []
        self.keep_outputs = True  # a forward's outputs Python has not read stay on the worker
        self.keep_min_bytes = 1024
        self.optimizers: weakref.WeakSet = weakref.WeakSet()  # RemoteOptimizers bound here
        # a replica's client (data parallelism): its slots mirror this client's, filled worker to worker
        self.replica_of: TrainingClient | None = None
        connection.pending_hooks.append(self._take_pending)
        connection.before_close.append(self.pull_before_close)

    @property
    def closed(self) -> bool:
        return self.connection.closed

    @property
    def bound(self) -> bool:
        """Some parameter lives in a worker slot: the worker holds parameters of record."""
        return self.slots.bound

    def owns_state_in(self, args: Sequence) -> bool:
        """Some argument is a placeholder for an activation kept on the worker."""
        return any(handle_of(a) is not None for a in args)

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

    def _take_pending(self) -> dict | None:
        """This client's deferred housekeeping, for the connection's next request (None: nothing)."""
        slots = self.slots.take_dropped()
        optims, self._dropped_optims = self._dropped_optims, []
        zero, self._zero_grad = self._zero_grad, []
        if not (slots or optims or zero):
            return None
        return dict(slots=slots, optims=optims, zero_grad=zero)

    def request(self, body, frames: Sequence = (), expect: type | None = None):
        """Send a training request and wait for its reply (deferred housekeeping rides on it)."""
        return self.connection.request(body, frames, expect=expect)

    def post(self, body, frames: Sequence = (), *, what: str = "", step: bool = False,
             on_reply=None, expect: type | None = m.Ok) -> Launched:
        """Send a training request without waiting: an effect (slots bound, gradients added, an
        optimizer step); a failure is raised at the next read on this worker (see
        :mod:`remotorch.client.stream`)."""
        launched = Launched(what or type(body).__name__, on_reply, expect, effect=on_reply is None,
                            step=step, origin=origin.here())
        return self.connection.link.launch(body, frames, launched)

    def flush(self) -> None:
        """Send deferred housekeeping now (normally it waits for the next request)."""
        self.connection.flush()

    # -------------------------------------------------------------------- slots
    def claim(self, t: torch.Tensor) -> Slot:
        """This session's slot for a parameter; ForeignParameterError if another session holds it."""
        other = owner_of(t)
        if other is not None and other is not self and other is not self.replica_of and not other.closed \
                and other.slots.lookup(t) is not None:
            raise errors.ForeignParameterError(
                f"parameter of shape {list(t.shape)} is held by another session's worker; "
                "use that session (or pull it and close that session first)")
        return self.slots.get_or_new(t, own=self.replica_of is None)

    def bind_stale(self, tensors: Iterable[torch.Tensor]) -> None:
        """Upload local values into the slots whose local copy moved (or that are new)."""
        conn = self.connection
        todo = []
        for t in tensors:
            slot = self.claim(t)
            if self.slots.stale(slot, t) and all(slot is not d[1] for d in todo):
                todo.append((t, slot))
        if not todo:
            return
        w, values, lent = FrameWriter(), [], []
        remote = [t for t, _ in todo if type(t) in REMOTE]
        if remote:  # a value the worker keeps (weights it loaded): the slot takes it there, by handle
            conn.import_values(remote)
        if conn.keeps_disk_cache():  # by content id: a restarted worker takes them from its disk
            lent = conn.refs([t for t, _ in todo if type(t) not in REMOTE and conn.held(t) is None])
        for t, _ in todo:
            if type(t) in REMOTE:
                values.append(value_arg(conn, t, w))
                continue
            tid = conn.held(t)
            values.append(m.RefArg(tid) if tid is not None else w.tensor(t))
        stamps = [stamp(t) for t, _ in todo]
        self.post(m.BindSlots([slot.sid for _, slot in todo], values), w.frames,
                  what=f"binding {len(todo)} parameter(s) to their values")
        for tid in lent:  # each slot took its own copy
            conn.release(tid)
        for (_, slot), now in zip(todo, stamps):
            slot.stamp = now
            slot.stepped = False
        self.slots.bound = True
        conn.stats.tensors_uploaded += len(w.frames)
        waiting = [o for t, _ in todo for o in waiting_optimizers(t)]
        for opt in dict.fromkeys(waiting):  # optimizers made before any session used these parameters
            opt.bind(self)

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
        w = FrameWriter()
        metas = [w.meta(p.grad) for p in todo]
        self.post(m.AccumulateGrads([self.slots.lookup(p).sid for p in todo], metas), w.frames,
                  what=f"adding {len(todo)} local gradient(s)")
        for p in todo:
            p.grad = None
        return todo

    # ---------------------------------------------------------------------- run
    def run(self, graph: Graph, args: Sequence) -> list:
        """Run a graph with state kept on the worker; saved outputs of a forward come back as placeholders.

        Once the graph ran on this worker, a call is sent without waiting
        (:mod:`remotorch.client.launch`): the saved activations, the outputs
        kept there and the gradients left there stand here at once.
        """
        conn = self.connection
        call = ForwardCall(len(args), backward_of=next((call_of(a) for a in args if handle_of(a) is not None), None))

        def placed(graph: Graph, args: Sequence) -> list:
            return self._place(graph, args, call)

        policy = conn.policies.of(graph)
        layout = launchable(graph, policy, args)
        taken = _taken(graph, args)
        if layout is None:
            reply, frames = conn.run(graph, args, placed=placed,
                                     fields=lambda: dict(self._fields(graph, call), **taken))
            policy.ran = True
            return self._unpack(graph, reply, frames, call)
        grads = self._grads(graph, call)
        unread = self.connection.policies.of(graph).keep(graph)  # (stay until the reply, at least)
        keep = self._keep(graph)
        echo = [i for i in unread if i not in keep or nbytes(layout[i]) < self.keep_min_bytes]
        plan = Plan(conn, graph, layout, unread, echo=echo, saved=lambda hid: activation(self.handles, hid, call),
                    grads=[i for i, _ in grads])
        saved_from = graph.saved_from if graph.saved_from is not None else -1
        return launch(conn, graph, args, plan, fields=dict(saved_from=saved_from, **m.grad_fields(grads), **taken),
                      placed=placed)

    def _place(self, graph: Graph, args: Sequence, call: ForwardCall) -> list:
        """The arguments this client places: saved activations by handle, trainable parameters by
        slot, other weights and buffers by content id (the rest go as the connection packs them)."""
        resident = graph.resident_set
        slotted = {i for i in graph.resident if self._wants_slot(graph, args[i])}
        self.bind_stale([args[i] for i in graph.resident if i in slotted])
        plain = [i for i in graph.resident if i not in slotted and type(args[i]) not in REMOTE]
        refs = dict(zip(plain, self._content_ids([args[i] for i in plain])))
        run_args: list = [None] * len(args)
        for i, a in enumerate(args):
            hid = handle_of(a)
            if hid is not None:
                run_args[i] = m.HandleArg(hid)
            elif type(a) in REMOTE and i not in slotted:
                continue  # a value kept on a worker: the connection names it by handle
            elif i in refs:
                run_args[i] = m.RefArg(refs[i])
            elif i in resident:
                slot = self.slots.lookup(a)
                if slot.optims:  # its optimizer is on the worker: so are its gradients
                    call.slots[i] = slot.sid
                    call.params[i] = a
                run_args[i] = m.SlotArg(slot.sid)
            elif graph.kind == "backward" and isinstance(a, torch.Tensor) and all_zero(a):
                # autograd's made-up gradient for an output that got none: its layout is enough
                # (a layout with gaps or overlap travels row-major, as its bytes would)
                strides = list(a.stride())
                dense = strides != contiguous_strides(a.shape) and is_permuted_contiguous(a.shape, strides)
                run_args[i] = m.ZerosArg(dtype_name(a.dtype), list(a.shape), strides if dense else [])
        return run_args

    def _fields(self, graph: Graph, call: ForwardCall) -> dict:
        """What becomes of the outputs: saved for backward, kept until read, gradients into slots."""
        saved_from, n_saved = -1, 0
        if graph.saved_from is not None:
            saved_from = graph.saved_from
            n_saved = sum(d is not None for d in graph.output_devices[saved_from:])
        grads = self._grads(graph, call)
        into_slots = {i for i, _ in grads}
        keep = [i for i in self._keep(graph) if i not in into_slots]
        base = self.handles.reserve(n_saved + len(keep)) if n_saved or keep else 0
        return dict(saved_from=saved_from, handle_base=base, **m.grad_fields(grads), keep=keep,
                    keep_min_bytes=self.keep_min_bytes)

    def _keep(self, graph: Graph) -> list[int]:
        """Outputs that stay on the worker until read: those Python has not read before, of any graph
        (once parameters live on the worker, inference graphs run here too: a generation's cache
        stays on the worker as it would in a session that never trained)."""
        if not self.keep_outputs:
            return []
        return self.connection.policies.of(graph).keep(graph)

    def _grads(self, graph: Graph, call: ForwardCall) -> list[list[int]]:
        """``[output index, slot id]``: the gradients a backward leaves in parameter slots (those an
        optimizer on the worker manages, when this backward pass accumulates them)."""
        backward_of = call.backward_of
        if backward_of is None or backward_of.n_inputs != len(graph.output_devices):
            return []
        return [[i, sid] for i, sid in backward_of.slots.items()
                if accumulated_by_this_backward(backward_of.params[i])]

    def _content_ids(self, tensors: list) -> list[str]:
        """Content ids for resident tensors that do not train (buffers, frozen weights).

        A training forward typically updates buffers (batch norm statistics):
        the new value gets a new id and is uploaded, and the superseded one is
        released on the worker, or it would hold one copy per step.
        """
        conn = self.connection
        replaced = [conn.ids.get(t)[1] for t in tensors]  # hashes what changed; refs() then finds it
        ids = conn.refs(tensors)
        live = set(ids)
        for previous in replaced:
            if previous is not None and previous not in live:
                conn.uploads.release(previous)
        return ids

    def _wants_slot(self, graph: Graph, t) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        if graph.saved_from is not None and t.requires_grad:
            return True  # a trainable parameter of a training forward
        return self.slots.lookup(t) is not None

    def _unpack(self, graph: Graph, reply, frames: list, call: ForwardCall) -> list:
        if len(reply.outputs) != len(graph.output_devices):
            raise errors.ProtocolError("worker answered a training run with the wrong number of outputs")
        reader, outs = FrameReader(frames), []
        for i, (arg, device) in enumerate(zip(reply.outputs, graph.output_devices)):
            if isinstance(arg, m.HandleArg):
                outs.append(activation(self.handles, arg.id, call))
            elif isinstance(arg, m.KeptArg):  # a value that stays on the worker until read
                self.handles.seen(arg.id)
                outs.append(placeholder(self.connection, arg, device, self.connection.policies.of(graph), i,
                                        cls=RemoteGrad if graph.kind == "backward" else None))
            else:
                outs.append(reader.value(arg, device))
        return outs

    def pull_before_close(self) -> None:
        """Before the session ends: the parameters an optimizer trained on the worker back into
        their local tensors, and each worker-side optimizer's state into the optimizer here.

        So a model trained inside ``with Session():`` holds its trained values
        after the block, and ``opt.state_dict()`` still answers; the optimizer
        binds again, with that state, to the next session that uses its parameters.
        """
        if self.replica_of is not None:  # a replica holds what the client it mirrors brings back
            return
        stepped = [t for t, slot in self.slots.items() if slot.stepped and not self.slots.stale(slot, t)]
        if stepped:
            self.pull_tensors(stepped)
        for opt in list(self.optimizers):
            opt.take_state()

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
        with self.connection.lock:
            pairs = [(t, self.slots.lookup(t)) for t in tensors]
            for t, slot in pairs:
                if slot is not None and self._shares_handle(t):
                    slot.stepped = False  # its slot is its handle's memory: a read fetches the trained value
            pairs = [(t, slot) for t, slot in pairs if slot is not None and slot.stamp is not None
                     and not self._shares_handle(t)]
            if not pairs:
                return 0
            self.bind_stale([t for t, _ in pairs])  # a local change made since wins, as on a call
            reply, frames = self.request(m.PullSlots([slot.sid for _, slot in pairs], grads), expect=m.PullReply)
            if len(reply.values) != len(pairs):
                raise errors.ProtocolError("worker answered a pull with the wrong number of values")
            reader = FrameReader(frames)
            for (t, slot), meta in zip(pairs, reply.values):
                with torch.no_grad():
                    t.copy_(reader.tensor(meta))
                slot.stamp = stamp(t)
                slot.stepped = False
            for (t, slot), meta in zip(pairs, reply.grads if grads else []):
                if slot.optims:  # other gradients live in p.grad already
                    t.grad = None if meta is None else reader.tensor(meta).clone().to(t.device)
        return len(pairs)


    def _shares_handle(self, t: torch.Tensor) -> bool:
        """``t`` stands for a value this worker keeps (its slot was bound to that very memory)."""
        ref = remote_ref(t)
        return ref is not None and ref.conn is self.connection


_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def all_zero(t: torch.Tensor) -> bool:
    """Every bit of ``t`` is zero (so -0.0 is not): it may travel as its layout alone."""
    if t.is_complex() or t.is_sparse or t.device.type == "meta" or t.numel() == 0:
        return False
    bits = _SAME_WIDTH_INT.get(t.element_size())
    if bits is None:
        return False
    with torch.no_grad():
        return not bool(t.detach().view(bits).any())


def accumulated_by_this_backward(t: torch.Tensor) -> bool:
    """True when the running backward pass accumulates into ``t.grad``.

    So it does in ``loss.backward()`` (and for ``t`` among ``backward(inputs=…)``);
    then the gradient may stay on the worker. Under ``torch.autograd.grad`` the
    engine captures the gradient instead (and refuses to answer for a leaf),
    so it must come back to the caller.
    """
    try:
        with torch.enable_grad(), torch._C.DisableTorchFunctionSubclass():  # (a stand-in: no read)
            node = t.view_as(t).grad_fn.next_functions[0][0]  # t's AccumulateGrad node
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:
        return False  # "a leaf node was passed ... while running autograd.grad()"
    except (AttributeError, IndexError):
        return True


def _taken(graph: Graph, args: Sequence) -> dict:
    """``Run.take`` for a backward whose autograd graph is not kept (no ``retain_graph``, no
    ``create_graph``): its saved activations, which aot_autograd has cleared here already
    (``ctx.maybe_clear_saved_tensors()``), are freed on the worker as the graph last uses each."""
    if graph.kind != "backward" or torch._C._autograd._get_current_graph_task_keep_graph():
        return {}
    hids = sorted({h for h in map(handle_of, args) if h is not None})
    runs: list[list[int]] = []  # [first, count]: the saved activations' ids are mostly consecutive
    for h in hids:
        if runs and runs[-1][0] + runs[-1][1] == h:
            runs[-1][1] += 1
        else:
            runs.append([h, 1])
    return {"take": [tuple(r) for r in runs]} if runs else {}

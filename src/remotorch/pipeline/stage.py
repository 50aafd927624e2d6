"""One pipeline stage on its worker: its graphs uploaded once, and the requests of its forward and backward.

A stage's forward (a ``Run``, sent through ``Connection.run`` like every
other) takes its parameters as slots of the worker's training client, buffers by content id, the microbatch's leaves
inline and activations of earlier stages as handles already delivered to
this worker; it keeps what backward needs as handles, and delivers each
output to the stages that take it (``send``: worker to worker under their
tickets) or keeps it here when the taker is on the same worker. The
backward takes the saved handles and the output gradients, accumulates
parameter gradients into the slots (``grads``) and delivers the input
gradients to the stages that produced those inputs. Only the last stage's
loss comes back to the client.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .. import errors
from ..capture.graph import output_devices
from ..client import origin
from ..client.launched import Launched
from ..client.remote import remote_ref
from ..client.values import value_arg
from ..codec import messages as m
from ..codec.frames import FrameReader
from ..codec.graph import GraphPayload, encode_graph
from ..codec.rngstate import draws_random
from ..training.client import TrainingClient
from .split import PipelineSplitError, StageGraphs


@dataclass(eq=False)
class StageGraph:
    """One graph of a stage (its forward or its backward) as a connection runs it: uploaded once."""

    payload: GraphPayload
    engine: str
    random: bool = False  # it draws random numbers (from this process's generator: client/rng.py)

    @property
    def graph_id(self) -> str:
        return self.payload.graph_id


def _payload(gm: torch.fx.GraphModule, what: str) -> GraphPayload:
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    try:
        with unset_fake_temporarily():
            return encode_graph(gm)
    except errors.UnsupportedGraphError as exc:
        raise PipelineSplitError(f"{what} cannot run remotely: {exc}") from exc


@dataclass
class Delivery:
    """Tensors one action sends to one other worker: which outputs, and the ticket to present."""

    outputs: list[int]
    url: str = ""
    ticket: m.TicketReply | None = None


@dataclass
class MicrobatchHandles:
    """Handles of one microbatch on one stage's worker (ids in that worker's session)."""

    inputs: dict[int, int] = field(default_factory=dict)  # stage input position -> handle id
    tangents: dict[int, int] = field(default_factory=dict)  # output index -> handle id of its gradient
    saved: list[int] = field(default_factory=list)


class StageRunner:
    """Requests of one stage: ``forward`` and ``backward`` of a microbatch, on its worker."""

    def __init__(self, graphs: StageGraphs, client: TrainingClient, engine: str = "eager") -> None:
        self.graphs = graphs
        self.client = client
        self.conn = client.connection
        self.forward_graph = StageGraph(_payload(graphs.forward, f"stage {graphs.index} forward"), engine,
                                        draws_random(graphs.forward))
        self.backward_graph = StageGraph(_payload(graphs.backward, f"stage {graphs.index} backward"), engine,
                                         draws_random(graphs.backward))
        self.grad_devices = output_devices(graphs.backward)
        if len(self.grad_devices) != len(graphs.inputs):
            raise PipelineSplitError(f"stage {graphs.index}: its backward does not give one gradient per input")
        self.params = [t for s, t in zip(graphs.inputs, graphs.tensors) if s.kind == "param"]

    @property
    def index(self) -> int:
        return self.graphs.index

    def has_grad(self, position: int) -> bool:
        """Whether the backward computes a gradient for input ``position``."""
        return self.grad_devices[position] is not None

    def bind(self) -> None:
        """Put the stage's parameters in worker slots (uploading those changed here since)."""
        with self.conn.lock:
            self.client.bind_stale(self.params)

    # ------------------------------------------------------------------ forward
    def forward(self, mb: MicrobatchHandles, leaves: list, targets: list, sends: list[Delivery],
                keep: list[int], answered: Callable[[object], None]) -> dict[int, int]:
        """Send the forward of one microbatch, without waiting: output -> handle id of the outputs in
        ``keep`` (kept on this worker for a stage here). ``answered(loss)`` runs when its reply is
        read, with the loss on the last stage (else None)."""
        g = self.graphs
        values, placed = [], []
        buffers = [t for s, t in zip(g.inputs, g.tensors) if s.kind == "buffer" and remote_ref(t) is None]
        if len(buffers) < sum(s.kind == "buffer" for s in g.inputs):  # some a worker keeps (it loaded them)
            self.conn.import_values([t for t in g.tensors if remote_ref(t) is not None])  # (its own: no move)
        with self.conn.lock:
            refs = iter(self.conn.refs(buffers)) if buffers else iter(())
            for pos, src in enumerate(g.inputs):
                value, arg = None, None
                if src.kind == "param":
                    arg = m.SlotArg(self.client.slots.lookup(g.tensors[pos]).sid)
                elif src.kind == "buffer":  # a worker's value (loaded there) by handle, else by content id
                    t = g.tensors[pos]
                    arg = value_arg(self.conn, t, None) if remote_ref(t) is not None else m.RefArg(next(refs))
                elif src.kind == "input":
                    value = leaves[src.index]
                elif src.kind == "target":
                    value = targets[src.index]
                else:
                    arg = m.HandleArg(mb.inputs[pos])
                values.append(value)
                placed.append(arg)
            base = self.client.handles.reserve(g.n_saved + len(keep))
        fields = dict(saved_from=g.n_outputs, handle_base=base, keep=keep, send=[_send(d) for d in sends])
        kept = self._kept(base + g.n_saved, keep)

        def read(outs: list, frames: list) -> None:
            self._check_kept(outs, kept)
            answered(FrameReader(frames).value(outs[0]) if not g.consumers else None)  # the last stage's loss

        self._run(self.forward_graph, values, placed, fields, g.n_outputs + g.n_saved, read)
        mb.saved = [base + i for i in range(g.n_saved)]
        for hid in mb.saved:
            self.client.handles.seen(hid)
        for pos in [p for p, s in enumerate(g.inputs) if s.kind == "stage"]:
            self.client.handles.release(mb.inputs[pos])  # the forward saved what it needs of them
        return kept

    # ----------------------------------------------------------------- backward
    def backward(self, mb: MicrobatchHandles, scale: torch.Tensor | None, sends: list[Delivery],
                 keep: list[int], answered: Callable[[object], None]) -> dict[int, int]:
        """Send the backward of one microbatch, without waiting; returns input position -> handle id of
        gradients kept here. ``answered(None)`` runs when its reply is read."""
        g = self.graphs
        placed: list = [m.HandleArg(h) for h in mb.saved]
        values: list = [None] * len(placed)
        for k in g.tangent_of:
            if k in mb.tangents:
                placed.append(m.HandleArg(mb.tangents[k]))
                values.append(None)
            else:  # the loss: d(total)/d(loss of this microbatch); or zeros, taken only where no gradient flows
                dtype, shape, _ = g.output_meta[k]
                placed.append(None)
                values.append(scale if scale is not None else torch.zeros(shape, dtype=dtype))
        with self.conn.lock:
            grads = [[pos, self.client.slots.lookup(g.tensors[pos]).sid] for pos in g.params
                     if self.has_grad(pos)]
            base = self.client.handles.reserve(len(keep)) if keep else 0
        fields = dict(handle_base=base, **m.grad_fields(grads), keep=keep, send=[_send(d) for d in sends])
        kept = self._kept(base, keep)
        self._run(self.backward_graph, values, placed, fields, len(g.inputs),
                  lambda outs, _frames: (self._check_kept(outs, kept), answered(None)))
        for hid in (*mb.saved, *mb.tangents.values()):
            self.client.handles.release(hid)
        mb.saved, mb.tangents = [], {}
        return kept

    def _run(self, graph: StageGraph, values: list, placed: list, fields: dict, n_outputs: int,
             read: Callable[[list, list], None]) -> None:
        """One stage request through the connection's run path, sent without waiting; ``read(outputs,
        frames)`` when its reply is read (a stage's activations and gradients go worker to worker,
        and the worker runs its requests in order: nothing here needs the reply before the next)."""
        def on_reply(reply, frames) -> None:
            if len(reply.outputs) != n_outputs:
                raise errors.ProtocolError("worker answered a pipeline stage with the wrong number of outputs")
            read(reply.outputs, frames)

        launched = Launched(f"stage {self.index} {'forward' if graph is self.forward_graph else 'backward'}",
                            on_reply, m.RunReply, effect=True, origin=origin.here())
        self.conn.run(graph, values, placed=lambda _g, _a: list(placed), fields=fields, launched=launched)

    def _kept(self, base: int, keep: list[int]) -> dict[int, int]:
        """Output index -> handle id of the outputs the worker keeps for a stage on it (the j-th of
        ``keep`` gets ``base + j``)."""
        kept = {k: base + j for j, k in enumerate(keep)}
        for hid in kept.values():
            self.client.handles.seen(hid)
        return kept

    def _check_kept(self, outputs: list, kept: dict[int, int]) -> None:
        for k, hid in kept.items():
            out = outputs[k]
            if not isinstance(out, m.KeptArg) or out.id != hid:
                raise errors.LimitExceededError("the worker could not keep a stage's activation or gradient "
                                                "(over the session's memory quota)")


def _send(d: Delivery) -> m.SendOutputs:
    return m.SendOutputs(d.outputs, d.url, d.ticket.ticket_id, d.ticket.secret)

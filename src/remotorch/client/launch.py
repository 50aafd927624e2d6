"""A graph run sent without waiting: placeholders for its outputs at once, made real by its reply.

The graph's output layouts are known before it runs (``graph.layouts(args)``,
:mod:`remotorch.capture.layout`), so every output can stand here at once:

* an output the worker keeps (``keep``) is a placeholder for its handle,
  which the next graph takes by reference and a read fetches;
* an output that comes back (one Python read before) is a placeholder the
  reply fills (a read of it waits for that reply: one round trip at most);
  the worker keeps it too until then, so a graph sent meanwhile names it;
* a training forward's saved activations are the training client's empty
  placeholders for their handles; a gradient accumulated into a parameter
  slot is None; a size is its value, computed.

A backward graph's tensor outputs are :class:`~remotorch.client.remote.RemoteGrad`
placeholders: the autograd engine may pass them on to the next backward graph
(by reference) without reading them.

The reply is checked against what was promised; a failure marks every
placeholder of the call failed, and a read raises it (see
:mod:`remotorch.client.stream`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch

from .. import errors
from ..codec import messages as m
from ..codec.frames import FrameReader
from ..codec.tensors import contiguous_strides, dtype_name
from . import origin
from .graph import Graph
from .placeholders import fill, placeholder
from .remote import RemoteGrad, RemoteTensor
from .launched import Launched

# saved(handle id) -> the local stand-in of a saved activation (the training client's)
Saved = Callable[[int], torch.Tensor]


class Plan:
    """What becomes of each output of one launched run, and the placeholders made for them.

    A tensor output in ``keep`` (Python has not read it before) stays on the
    worker as a handle, so a later request may name it at once; those in
    ``echo`` too (small ones) also come back in the reply (``Run.echo``),
    which fills their placeholders, and their handles go when the value is
    here. Any other tensor output (one Python read before) only comes back in
    the reply: a graph sent before that reply is read, taking it, waits for
    it (the program read it before, so it usually reads it again first).
    """

    def __init__(self, conn, graph: Graph, layout: list, keep: Sequence[int], *, echo: Sequence[int] = (),
                 saved: Saved | None = None, grads: Sequence[int] = (), base: int | None = None) -> None:
        self.conn, self.graph, self.layout = conn, graph, layout
        saved_from = graph.saved_from if saved is not None and graph.saved_from is not None else len(layout)
        self.saved = [i for i in range(saved_from, len(layout)) if _is_tensor(layout[i])]
        self.grads = set(grads)
        self.keep = [i for i in keep if i < saved_from and _is_tensor(layout[i]) and i not in self.grads]
        echoed = set(echo)
        self.echo = [i for i in self.keep if i in echoed]
        n = len(self.saved) + len(self.keep)
        if base is None:  # (given: the handles were reserved already, as client.prepared does)
            base = conn.handles.reserve(n) if n else 0
        self.base = base
        self.ids = {i: self.base + j for j, i in enumerate([*self.saved, *self.keep])}
        self._saved = saved
        self._made: dict[int, weakref.ref] = {}  # output index -> its placeholder (weakly)

    def adopt(self, made: dict[int, weakref.ref]) -> None:
        """Take placeholders made elsewhere for this plan's outputs (output index -> weakly)."""
        self._made = made

    def strides(self) -> list[list[int]]:
        """The strides promised for each kept output, in ``keep`` order (the worker makes them so;
        empty: row-major)."""
        out = []
        for i in self.keep:
            spec = self.layout[i]
            out.append([] if list(spec.strides) == contiguous_strides(spec.shape) else list(spec.strides))
        return out

    def outputs(self, launched: Launched) -> list:
        """Python's stand-ins for every output, now."""
        conn, graph, cls = self.conn, self.graph, RemoteGrad if self.graph.kind == "backward" else RemoteTensor
        policy = conn.policies.of(graph)
        saved = set(self.saved)
        out = []
        for i, (spec, device) in enumerate(zip(self.layout, graph.output_devices)):
            if i in self.grads:
                out.append(None)
            elif not _is_tensor(spec):
                out.append(spec)
            elif i in saved:  # (the saved placeholder counts its handle as held)
                out.append(self._saved(self.ids[i]))
            else:
                hid = self.ids.get(i, 0)  # 0: it comes back in the reply
                if hid:
                    conn.handles.seen(hid)
                ph = placeholder(conn, m.KeptArg(hid, "", list(spec.shape), list(spec.strides)), device, policy, i,
                                 launched, cls=cls, dtype=spec.dtype)
                self._made[i] = weakref.ref(ph)
                out.append(ph)
        return out

    def on_reply(self, reply, frames: list) -> None:
        """Check the reply against the plan (a brief reply: what it says); fill what came back.

        Outputs a brief reply leaves out were disposed of as planned: saved,
        kept (with the promised strides) or accumulated; each kept one needs
        nothing more than the reply having come.
        """
        if len(reply.at) != len(reply.outputs) or not all(0 <= i < len(self.layout) for i in reply.at):
            raise errors.ProtocolError("worker answered a launched run with outputs it does not have")
        reader = FrameReader(frames)
        saved = set(self.saved)
        told = dict(zip(reply.at, reply.outputs))
        for i, spec in enumerate(self.layout):
            arg = told.get(i)
            if arg is None:
                if _is_tensor(spec) and i not in self.ids and i not in self.grads:
                    raise errors.ProtocolError(f"output {i}: the worker's reply lacks a value it was to send")
                if i in self._made:
                    self._settled(i)
            elif i in self.grads or i in saved:
                _expect(arg, m.ScalarArg(None) if i in self.grads else m.HandleArg(self.ids[i]), i)
            elif not _is_tensor(spec):
                _expect(arg, m.ScalarArg(spec), i)
            else:
                self._made_real(i, arg, spec, reader)

    def _settled(self, i: int) -> None:
        ref = self._made.get(i)
        ph = ref() if ref is not None else None
        if ph is not None and "_rt_ref" in ph.__dict__:
            ph._rt_ref.launched = None  # made: reads need not wait for anything

    def _made_real(self, i: int, arg, spec, reader: FrameReader) -> None:
        ref = self._made.get(i)
        ph = ref() if ref is not None else None
        kind = type(arg)
        if kind is m.TensorArg or kind is m.EchoArg:  # sent back (asked to, or over the quota): fill it
            meta = arg.meta
            if tuple(meta.shape) != spec.shape or (kind is m.EchoArg and arg.id != self.ids.get(i)):
                raise errors.ProtocolError(f"graph {self.graph.graph_id[:12]}: output {i} came back as "
                                           f"{arg!r}, not as planned ({list(spec.shape)})")
            if ph is not None and "_rt_ref" in ph.__dict__ and not ph._rt_ref.written:  # (written: stale)
                value = reader.tensor(meta)
                self.conn.reuse.returned(self.graph, i, ph)
                fill(ph, value)
            return
        _expect(arg, m.KeptArg(self.ids[i], dtype_name(spec.dtype), list(spec.shape), list(spec.strides)), i)
        self._settled(i)


def _is_tensor(spec) -> bool:
    return hasattr(spec, "strides")


def _expect(arg, want, i: int) -> None:
    if arg != want:
        raise errors.ProtocolError(f"output {i}: the worker answered {arg!r} where {want!r} was planned")


def launch(conn, graph: Graph, args: Sequence, plan: Plan, *, fields: dict | Callable[[], dict],
           placed=None, step: bool = False, on_read=None) -> list:
    """Send the run; Python's stand-ins for its outputs, at once (see :class:`Plan`). ``on_read``: see
    :class:`~remotorch.client.stream.Launched`."""
    launched = Launched(getattr(graph, "label", "") or f"graph {graph.graph_id[:12]}", plan.on_reply, m.RunReply, makes=tuple(
        ("h", h) for h in plan.ids.values()), origin=origin.here(), step=step, on_read=on_read)
    launched.coalesce = getattr(graph, "eager_op", False)  # an eager call's: it may leave with the next ones
    outs = plan.outputs(launched)

    def all_fields() -> dict:
        extra = fields() if callable(fields) else dict(fields)
        extra.update(keep=plan.keep, handle_base=plan.base, keep_min_bytes=0, echo=plan.echo, brief=True)
        strides = plan.strides()
        if any(strides):  # else every kept output is row-major, which a brief run means by default
            extra["strides"] = strides
        return extra

    try:
        conn.run(graph, args, fields=all_fields, placed=placed, launched=launched)
    except errors.RemoteError as exc:  # never sent: a placeholder that outlives this raises it when read
        launched.error, launched.done = exc, True
        raise
    return outs


def nbytes(spec) -> int:
    """Bytes of an output of this layout (0 for a value that is not a tensor)."""
    if not _is_tensor(spec):
        return 0
    n = spec.dtype.itemsize
    for s in spec.shape:
        n *= s
    return n


def launchable(graph: Graph, policy, args: Sequence) -> list | None:
    """The graph's output layouts for these arguments, when a call may be sent without waiting: it
    ran on this connection before, aot_autograd's runtime reads none of its outputs here at once,
    and the layouts can be computed. Else None (the call waits for its reply)."""
    if not policy.ran or graph.must_real:
        return None
    layouts = getattr(graph, "layouts", None)
    layout = layouts(args) if layouts is not None else None
    if layout is None or layout is policy.plain_layout:  # (a static layout is one list: checked once)
        return layout
    if any(_is_tensor(s) and _overlapping(s) for s in layout):
        return None  # an output that views one element many times (an expand) is no buffer to fill here
    policy.plain_layout = layout
    return layout


def _overlapping(spec) -> bool:
    return any(stride == 0 and size > 1 for size, stride in zip(spec.shape, spec.strides))

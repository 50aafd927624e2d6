"""What becomes of each output of a run: the plan a ``Run`` message carries, applied in one place.

An output is, in this order of precedence:

* **saved** for a backward (index >= ``saved_from``): a handle, answered ``HandleArg``;
* **kept** until Python reads it (in ``keep``, within the session's quota and
  ``keep_min_bytes``): a handle, answered ``KeptArg`` with its layout, or, in
  ``echo``, ``EchoArg``: kept and sent back inline too;
* **sent** to another worker under a ticket: answered as a nil scalar;
* **accumulated** into a parameter slot's gradient (``grads``): answered as a nil scalar;
* else sent back inline (the caller encodes it).

:func:`dispose` returns one entry per output: a wire argument for the first
four, the value itself for the last.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from ..codec import messages as m
from ..codec.tensors import contiguous_strides, dtype_from_name, dtype_name
from ..errors import InvalidRequestError, LimitExceededError, UnsupportedGraphError
from .handles import HandleStore
from .training import Trainables

# send(url, ticket_id, secret, tensors): deliver tensors to another worker
Send = Callable[[str, bytes, bytes, list], None]
_NIL = m.ScalarArg(None)


class Stores(Protocol):
    """Where outputs go (a :class:`remotorch.worker.worker.Worker` is one)."""

    handles: HandleStore
    trainables: Trainables

    def may_keep(self, session: object, nbytes: int) -> bool: ...


@dataclass(frozen=True, slots=True)
class OutputPlan:
    saved_from: int = -1
    handle_base: int = 0
    keep: tuple = ()
    keep_min_bytes: int = 0
    send: tuple = ()  # (m.SendOutputs, ...)
    strides: tuple = ()  # the strides promised for each kept output (a run sent without waiting)
    echo: frozenset = frozenset()  # kept outputs also sent back inline
    brief: bool = False  # a run sent without waiting: kept outputs row-major unless ``strides`` says

    @classmethod
    def of(cls, req: m.Run) -> OutputPlan:
        return cls(req.saved_from, req.handle_base, tuple(req.keep), req.keep_min_bytes,
                   tuple(req.send), tuple(req.strides), frozenset(req.echo), req.brief)


@dataclass(frozen=True, slots=True)
class Echo:
    """An output kept as handle ``id`` that also goes back inline (encoded as ``EchoArg``)."""

    id: int
    tensor: torch.Tensor


def grad_slots(worker: Stores, session: object, req: m.Run) -> dict[int, int]:
    """Output index -> slot id (``Run.grads_from``, ``grad_slots``), checked before the graph runs
    (a missing slot fails first)."""
    grads, first = {}, req.grads_from
    if first < 0:
        raise InvalidRequestError("grads_from is an output index: never negative")
    for k, sid in enumerate(req.grad_slots):
        if sid != -1:
            worker.trainables.slot(session, sid)
            grads[first + k] = sid
    return grads


def dispose(worker: Stores, session: object, plan: OutputPlan, outs: list, inputs: frozenset[int],
            grads: dict[int, int], send: Send) -> list:
    """Apply the plan to a run's outputs (``inputs``: the storages of the tensors the graph took, by
    address, when it makes gradients); one wire argument (or the value, to send inline) per output."""
    saved_ids: dict[int, int] = {}
    if plan.saved_from >= 0:
        saved = [i for i, o in enumerate(outs) if plan.saved_from <= i and isinstance(o, torch.Tensor)]
        saved_ids = dict(zip(saved, range(plan.handle_base, plan.handle_base + len(saved))))
        worker.handles.put(session, list(saved_ids.values()), [outs[i] for i in saved])
    kept = (_keep(worker, session, plan, outs, plan.handle_base + len(saved_ids), saved_ids)
            if plan.keep or plan.strides or plan.echo else {})
    sent = _send(plan.send, outs, send) if plan.send else set()
    # a gradient may alias an argument or another output (e.g. the incoming
    # gradient passed straight through): only a fresh tensor may become .grad
    taken = set(inputs)
    result, brief = [], plan.brief  # (a brief reply leaves out what went as planned: it is not made)
    for i, o in enumerate(outs):
        if i in saved_ids:
            result.append(_NIL if brief else m.HandleArg(saved_ids[i]))
        elif i in kept:
            hid, o = kept[i]
            result.append(Echo(hid, o) if i in plan.echo else _NIL if brief else
                          m.KeptArg(hid, dtype_name(o.dtype), list(o.shape), list(o.stride())))
        elif i in sent:
            result.append(_NIL)
        elif i in grads and isinstance(o, torch.Tensor):
            ptr = o.untyped_storage().data_ptr()
            worker.trainables.accumulate(session, grads[i], o, owned=ptr not in taken and not o._is_view())
            taken.add(ptr)
            result.append(_NIL)
        else:
            result.append(o)
    return result


def _keep(worker: Stores, session: object, plan: OutputPlan, outs: list, base: int,
          saved: dict) -> dict[int, tuple[int, torch.Tensor]]:
    """Output index -> (handle id, tensor kept) of the outputs kept here (``keep`` order, ids from ``base``)."""
    keep = plan.keep
    if len(set(keep)) != len(keep) or not all(type(i) is int and 0 <= i < len(outs) for i in keep):
        raise InvalidRequestError("keep must list distinct output indices")
    if plan.strides and len(plan.strides) != len(keep):
        raise InvalidRequestError("strides must give one list per kept output")
    if not plan.echo <= set(keep):
        raise InvalidRequestError("echo must list kept outputs only")
    ids, tensors = [], []
    room = 0
    for j, i in enumerate(keep):
        o = outs[i]
        if i in saved or not isinstance(o, torch.Tensor):
            continue
        if plan.strides or plan.brief:
            o = restrided(o, plan.strides[j] if plan.strides else ())
        size = o.numel() * o.element_size()
        if size < plan.keep_min_bytes or not worker.may_keep(session, room + size):
            continue  # over the quota: it travels back instead
        room += size
        ids.append((i, base + j))
        tensors.append(o)
    worker.handles.put(session, [h for _, h in ids], tensors)
    return {i: (h, t) for (i, h), t in zip(ids, tensors)}


def _check_layout(shape, strides, what: str) -> int:
    """Elements a tensor of this layout spans (raising for layouts that are not dense: each element
    addressed once, in no more memory than it holds)."""
    if len(strides) != len(shape) or not all(type(n) is int and n >= 0 for n in (*shape, *strides)):
        raise InvalidRequestError(f"strides {list(strides)} do not fit {what} of shape {list(shape)}")
    numel = 1
    for n in shape:
        numel *= n
    extent = 1 + sum((n - 1) * st for n, st in zip(shape, strides) if n > 0)
    if numel and extent > numel:
        raise InvalidRequestError(f"strides {list(strides)} spread {what} of shape {list(shape)} "
                                  "over more memory than it holds")
    return numel


def zeros(arg: m.ZerosArg, device: torch.device, max_bytes: int) -> torch.Tensor:
    """The tensor of zeros a ``ZerosArg`` names (dense layouts only, within the tensor size limit)."""
    try:
        dtype = dtype_from_name(arg.dtype)
    except (ValueError, KeyError, UnsupportedGraphError) as exc:
        raise InvalidRequestError(f"a tensor of zeros of an unknown dtype: {exc}") from None
    strides = arg.strides or contiguous_strides(arg.shape)
    numel = _check_layout(arg.shape, strides, "a tensor of zeros")
    if numel * dtype.itemsize > max_bytes:
        raise LimitExceededError(f"a tensor of zeros of {numel * dtype.itemsize} bytes is over the worker's "
                                 f"limit of {max_bytes}")
    return torch.zeros(arg.shape, dtype=dtype, device=device).as_strided(arg.shape, strides) \
        if numel else torch.empty_strided(arg.shape, strides, dtype=dtype, device=device)


def restrided(t: torch.Tensor, strides) -> torch.Tensor:
    """``t`` with exactly these strides (a copy when it has others): the layout the client promised.

    Empty ``strides``: row-major. Only layouts that address each element at
    most once in no more memory than the tensor needs (dense ones in any
    order): anything else is refused.
    """
    if strides:
        strides = list(strides)
        if strides == list(t.stride()):
            return t
    else:
        shape = t.shape
        if t.is_contiguous() and all(n > 1 for n in shape):  # (then row-major strides are the only ones)
            return t
        strides = contiguous_strides(shape)
        if strides == list(t.stride()):
            return t
    _check_layout(list(t.shape), strides, "an output")
    out = torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


def _send(sends, outs: list, send: Send) -> set[int]:
    """Deliver outputs to other workers under their tickets (a pipeline stage's activations or
    gradients); returns the indices sent. Each is sent contiguous, as tickets expect."""
    done: set[int] = set()
    for s in sends:
        if not s.outputs or any(type(i) is not int or not 0 <= i < len(outs) or i in done
                                or not isinstance(outs[i], torch.Tensor) for i in s.outputs):
            raise InvalidRequestError("send must name distinct tensor outputs")
        done.update(s.outputs)
        send(s.url, s.ticket_id, s.secret, [outs[i].contiguous() for i in s.outputs])
    return done

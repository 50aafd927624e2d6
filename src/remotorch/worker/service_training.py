"""Server side of the training messages: decode them, call the worker, encode the reply.

The worker's :class:`~remotorch.worker.training.TrainingState` holds the
state; this module only translates between messages and its methods, as
:mod:`remotorch.server` does for the core messages.
"""

from __future__ import annotations

import torch

from ..codec import messages as m
from ..codec.tensors import tensor_to_wire
from ..codec.values import value_to_arg
from ..errors import InvalidRequestError
from .worker import Worker


def serve_training(worker: Worker, session: object, req, frames: list) -> tuple[bytes, list]:
    """Handle one request of :data:`remotorch.codec.messages.TRAINING_REQUESTS`."""
    state = worker.training
    pending = req if isinstance(req, m.Pending) else req.pending
    if pending is not None:
        state.apply_pending(session, pending.zero_grad, pending.handles, pending.slots, pending.optims)
        worker.release_tensors(session, pending.tensors)
    if isinstance(req, m.RunResident):
        return _run(worker, session, req, frames)
    if isinstance(req, m.BindSlots):
        if len(req.slots) != len(req.values):
            raise InvalidRequestError("slot ids and values disagree")
        for sid, value in zip(req.slots, req.values):
            if isinstance(value, m.RefArg):
                state.bind(session, sid, worker.resident_tensor(session, value.id), private=False)
            else:
                state.bind(session, sid, worker.wire_tensor(value.meta, frames), private=True)
    elif isinstance(req, m.AccumulateGrads):
        if len(req.slots) != len(req.metas):
            raise InvalidRequestError("slot ids and gradients disagree")
        for sid, meta in zip(req.slots, req.metas):
            state.accumulate(session, sid, worker.wire_tensor(meta, frames), owned=True)
    elif isinstance(req, m.PullSlots):
        return _pull(state, session, req)
    elif isinstance(req, m.OptimCreate):
        state.optim_create(session, req.optim, req.name, req.groups, req.hyper)
    elif isinstance(req, m.OptimStep):
        state.optim_step(session, req.optim, req.hyper)
    elif isinstance(req, m.OptimZeroGrad):
        state.optim_zero_grad(session, req.optim, req.set_to_none)
    elif isinstance(req, m.OptimGetState):
        return _optim_state(state, session, req)
    elif isinstance(req, m.OptimSetState):
        entries = [(idx, key, worker.wire_tensor(v.meta, frames) if isinstance(v, m.TensorArg) else v.value)
                   for idx, key, v in req.entries]
        state.optim_set_state(session, req.optim, entries)
    elif isinstance(req, m.ClipGradNorm):
        norm = state.clip_grad_norm(session, req.optim, req.max_norm, req.norm_type, req.error_if_nonfinite)
        return m.encode(m.NormReply(norm)), []
    return m.encode(m.Ok()), []


def _run(worker: Worker, session: object, req: m.RunResident, frames: list) -> tuple[bytes, list]:
    state = worker.training
    args = []
    for a in req.args:
        if isinstance(a, m.HandleArg):
            args.append(state.handle(session, a.id))
        elif isinstance(a, m.SlotArg):
            args.append(state.slot(session, a.id).detach())
        elif isinstance(a, m.RefArg):
            args.append(("ref", a.id))
        elif isinstance(a, m.ScalarArg):
            args.append(a.value)
        else:
            args.append(worker.wire_tensor(a.meta, frames))
    grads = {}
    for pair in req.grads:
        if len(pair) != 2:
            raise InvalidRequestError("grads must be [output index, slot id] pairs")
        state.slot(session, pair[1])  # missing slots fail before the graph runs
        grads[pair[0]] = pair[1]
    outs, ms, compiled = worker.run(session, req.graph_id, req.engine, args, frames)
    # a gradient may alias an argument or another output (e.g. the incoming
    # gradient passed straight through): only a fresh tensor may become .grad
    taken = {t.untyped_storage().data_ptr() for t in args if isinstance(t, torch.Tensor)}
    keep = [i for i, o in enumerate(outs) if 0 <= req.keep_from <= i and isinstance(o, torch.Tensor)]
    kept = dict(zip(keep, state.keep(session, req.handle_base, [outs[i] for i in keep])))
    out_args, out_frames = [], []
    for i, o in enumerate(outs):
        if i in kept:
            out_args.append(m.HandleArg(kept[i]))
        elif i in grads and isinstance(o, torch.Tensor):
            ptr = o.untyped_storage().data_ptr()
            state.accumulate(session, grads[i], o, owned=ptr not in taken and not o._is_view())
            taken.add(ptr)
            out_args.append(m.ScalarArg(None))
        else:
            out_args.append(value_to_arg(o, out_frames))
    return m.encode(m.ResidentReply(out_args, ms, compiled)), out_frames


def _optim_state(state, session: object, req: m.OptimGetState) -> tuple[bytes, list]:
    entries, out_frames = [], []
    for idx, key, value in state.optim_state(session, req.optim):
        if isinstance(value, torch.Tensor):
            meta, buf = tensor_to_wire(value, len(out_frames))
            entries.append((idx, key, m.TensorArg(meta)))
            out_frames.append(buf)
        elif value is None or isinstance(value, (bool, int, float)):
            entries.append((idx, key, m.ScalarArg(value)))
        else:
            raise InvalidRequestError(f"optimizer state {key!r} is a {type(value).__name__}, which cannot travel")
    return m.encode(m.OptimStateReply(entries)), out_frames


def _pull(state, session: object, req: m.PullSlots) -> tuple[bytes, list]:
    values, grads = state.pull(session, req.slots, req.grads)
    metas, grad_metas, out_frames = [], [], []
    for v in values:
        meta, buf = tensor_to_wire(v, len(out_frames))
        metas.append(meta)
        out_frames.append(buf)
    for g in grads if req.grads else []:
        if g is None:
            grad_metas.append(None)
            continue
        meta, buf = tensor_to_wire(g, len(out_frames))
        grad_metas.append(meta)
        out_frames.append(buf)
    return m.encode(m.PullReply(metas, grad_metas)), out_frames

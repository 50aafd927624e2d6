"""The service's handlers of training requests (protocol.md §17): parameter slots, gradients,
optimizers. Each is ``handler(service, session, request, frames) -> (header, frames)``, taken into
:data:`remotorch.worker.service._HANDLERS`.
"""

from __future__ import annotations

import torch

from ..codec import messages as m
from ..codec.frames import SCALARS, FrameWriter
from ..errors import InvalidRequestError

from .replies import OK, Reply


def bind_slots(service, session, req: m.BindSlots, frames) -> Reply:
    if len(req.slots) != len(req.values):
        raise InvalidRequestError("slot ids and values disagree")
    state, reader = service.worker.trainables, service.worker.reader(frames)
    handles = service.worker.handles
    for sid, value in zip(req.slots, req.values):
        if isinstance(value, m.RefArg):
            state.bind(session, sid, service.worker.resident_tensor(session, value.id), private=False)
        elif isinstance(value, m.HandleArg):  # the very tensor: a step through the slot updates the handle
            state.bind(session, sid, handles.get(session, value.id), private=True)
        elif isinstance(value, m.ViewArg):
            state.bind(session, sid, handles.view(session, value.id, value.shape, value.strides, value.offset),
                       private=False)
        else:
            state.bind(session, sid, reader.tensor(value.meta), private=True)
    return OK, []


def accumulate_grads(service, session, req: m.AccumulateGrads, frames) -> Reply:
    if len(req.slots) != len(req.metas):
        raise InvalidRequestError("slot ids and gradients disagree")
    reader = service.worker.reader(frames)
    for sid, meta in zip(req.slots, req.metas):
        service.worker.trainables.accumulate(session, sid, reader.tensor(meta), owned=True)
    return OK, []


def pull_slots(service, session, req: m.PullSlots, frames) -> Reply:
    values, grads = service.worker.trainables.pull(session, req.slots, req.grads)
    w = FrameWriter()
    metas = [w.meta(v) for v in values]
    grad_metas = [None if g is None else w.meta(g) for g in grads] if req.grads else []
    return m.encode(m.PullReply(metas, grad_metas)), w.frames


def optim_create(service, session, req: m.OptimCreate, frames) -> Reply:
    service.worker.trainables.optim_create(session, req.optim, req.name, req.groups, req.hyper)
    return OK, []


def optim_step(service, session, req: m.OptimStep, frames) -> Reply:
    service.worker.trainables.optim_step(session, req.optim, req.hyper)
    return m.encode(m.Ok()), []  # (not ``OK``: a training loop's queue bound waits for it, never held)


def optim_zero_grad(service, session, req: m.OptimZeroGrad, frames) -> Reply:
    service.worker.trainables.optim_zero_grad(session, req.optim, req.set_to_none)
    return OK, []


def optim_get_state(service, session, req: m.OptimGetState, frames) -> Reply:
    w, entries = FrameWriter(), []
    for idx, key, value in service.worker.trainables.optim_state(session, req.optim):
        if not isinstance(value, (torch.Tensor, *SCALARS)):
            raise InvalidRequestError(f"optimizer state {key!r} is a {type(value).__name__}, which cannot travel")
        entries.append((idx, key, w.value(value)))
    return m.encode(m.OptimStateReply(entries)), w.frames


def optim_set_state(service, session, req: m.OptimSetState, frames) -> Reply:
    reader = service.worker.reader(frames)
    entries = [(idx, key, reader.value(v)) for idx, key, v in req.entries]
    service.worker.trainables.optim_set_state(session, req.optim, entries)
    return OK, []


def clip_grad_norm(service, session, req: m.ClipGradNorm, frames) -> Reply:
    norm = service.worker.trainables.clip_grad_norm(session, req.optim, req.max_norm, req.norm_type,
                                               req.error_if_nonfinite)
    return m.encode(m.NormReply(norm)), []


HANDLERS = {
    m.BindSlots: bind_slots, m.AccumulateGrads: accumulate_grads, m.PullSlots: pull_slots,
    m.OptimCreate: optim_create, m.OptimStep: optim_step, m.OptimZeroGrad: optim_zero_grad,
    m.OptimGetState: optim_get_state, m.OptimSetState: optim_set_state, m.ClipGradNorm: clip_grad_norm,
}

"""``remotorch.save``: checkpoints the worker writes itself, under a ``--checkpoints`` root.

A module is saved as ``transformers``' ``save_pretrained`` saves it:
``model.safetensors`` (split into ``model-0000i-of-0000n.safetensors`` with
``model.safetensors.index.json`` above a size), ``{"format": "pt"}`` in each
file's metadata, one key per tied tensor, and for a transformers model its
``config.json`` and ``generation_config.json``; so
``AutoModel*.from_pretrained`` reads the folder, and :func:`remotorch.from_pretrained`
too. Each tensor is taken where it is: a value the worker keeps (loaded there,
or trained there in a parameter slot) by reference, so nothing of it comes
to the client; a tensor that exists only here (a buffer never used
remotely) travels up once.

A :class:`~remotorch.optim.RemoteOptimizer` is saved as one safetensors file
of its state, with its hyperparameters in the file's metadata, and
:func:`remotorch.load_state_dict` of that file resumes it.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..client.remote import REMOTE, remote_ref
from ..client.session import Session, default_session
from ..client.values import value_arg
from ..codec import messages as m
from ..codec.frames import FrameWriter
from ..training.optim import RemoteOptimizer
from .load import session_of
from .meta import tensors_of


def save(obj, target: str, *, session: Session | None = None, max_shard_bytes: int = m.MAX_SHARD_BYTES) -> list[str]:
    """Have the worker write ``obj`` (a module or a ``RemoteOptimizer``) under ``target``.

    ``target`` is ``ROOT/relative/path`` under a ``--checkpoints`` root: a
    folder for a module, a ``.safetensors`` file for an optimizer. The
    session is ``session``, else the one whose worker holds ``obj``'s values,
    else the default one. One round trip; returns the files written.
    """
    if isinstance(obj, RemoteOptimizer):
        return _save_optimizer(obj, target)
    if not isinstance(obj, nn.Module):
        raise TypeError(f"remotorch.save takes a module or a RemoteOptimizer, not {type(obj).__name__}")
    session = session or _session_of(obj) or default_session()
    conn = session.connection
    trainer = session._trainers.get(id(conn))
    keys, tensors = [], []
    for w in tensors_of(obj):
        keys.append(w.keys[0])  # one key per tied tensor, the first the module registers (as save_pretrained)
        tensors.append(w.tensor)
    config, generation = _configs(obj, tensors)
    with conn.lock:
        remote = [t for t in tensors if type(t) in REMOTE]
        if remote:
            conn.import_values(remote)
        w = FrameWriter()
        values = [_value(conn, trainer, t, w) for t in tensors]
        reply = conn.request(m.SaveWeights(target, keys, values, config, generation, max_shard_bytes),
                             w.frames, expect=m.SaveReply)[0]
    return list(reply.files)


def _value(conn, trainer, t: torch.Tensor, w: FrameWriter):
    """How the worker finds a tensor: its handle, its trained slot, else its bytes from here."""
    if type(t) in REMOTE:
        return value_arg(conn, t, w)
    if trainer is not None:
        slot = trainer.slots.lookup(t)
        if slot is not None and slot.stamp is not None and not trainer.slots.stale(slot, t):
            return m.SlotArg(slot.sid)  # the worker's value is the one of record (trained there)
    if t.device.type == "meta":
        raise ValueError("a tensor on meta cannot be saved: load the module's weights first")
    return w.value(t.detach())


def _configs(model: nn.Module, tensors: list) -> tuple[str, str]:
    """``config.json`` and ``generation_config.json`` as ``save_pretrained`` writes them ("" if none)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_json_string"):
        return "", ""
    config = copy.deepcopy(config)
    config.architectures = [type(model).__name__]
    floating = next((t.dtype for t in tensors if t.is_floating_point()), None)
    if floating is not None:
        config.dtype = floating
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", lambda: False)()
    return (config.to_json_string(use_diff=True),
            generation.to_json_string(use_diff=True) if generation is not None and can_generate else "")


def _session_of(module: nn.Module):
    """The session whose worker keeps this module's loaded values (None when nothing of it is)."""
    for t in (*module.parameters(), *module.buffers()):
        ref = remote_ref(t)
        if ref is not None:
            session = session_of(ref.conn)
            if session is not None:
                return session
    return None


def _save_optimizer(opt: RemoteOptimizer, target: str) -> list[str]:
    client = opt._bound()
    with client.connection.lock:
        reply = client.request(m.SaveOptimizer(target, opt._id), expect=m.SaveReply)[0]
    return list(reply.files)


def load_optimizer(opt: RemoteOptimizer, source: str, revision: str | None = None) -> None:
    """Replace ``opt``'s state and hyperparameters with a file :func:`save` wrote (one round trip)."""
    client = opt._bound()
    with client.connection.lock:
        reply = client.request(m.LoadOptimizer(source, opt._id, revision or ""), expect=m.OptimLoaded)[0]
    opt.took_hyperparameters(reply.hyper)

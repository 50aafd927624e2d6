"""Optimizers that run on the worker, next to the parameters and gradients they update.

``RemoteOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-3)`` creates
``torch.optim.AdamW`` on the worker (looked up there by name; no code
travels) over the worker-side copies of the parameters; ``step()`` and
``zero_grad()`` run there and the optimizer state stays there.

It is a ``torch.optim.Optimizer`` itself, with ``param_groups`` mirroring the
worker's, so ``torch.optim.lr_scheduler`` schedulers work unchanged: each
``step()`` sends the hyperparameters that changed since the last one.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from ..codec import messages as m
from ..codec.tensors import tensor_from_wire, tensor_to_wire
from ..errors import ForeignParameterError, ProtocolError
from .params import owner_of
from .client import training_client

_PLAIN = (bool, int, float, str, type(None))
_MISSING = object()


def _plain(key: str, value):
    """A hyperparameter as it travels: a scalar, a string, or a list of numbers."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (tuple, list)) and all(isinstance(v, (bool, int, float)) for v in value):
        return list(value)
    raise TypeError(f"hyperparameter {key!r} must be a plain value (number, bool, str, None or a "
                    f"tuple of numbers) to run on the worker, got {type(value).__name__}")


class RemoteOptimizer(torch.optim.Optimizer):
    """``optimizer_class`` (any class of ``torch.optim``) running on the session's worker.

    ``params`` and the keyword hyperparameters are what ``optimizer_class``
    takes. The session is ``session``, else the one already holding the
    parameters, else the default session. Parameters held by another session
    raise :class:`~remotorch.errors.ForeignParameterError`.

    Gradients live on the worker: after ``loss.backward()`` the local
    ``p.grad`` stays ``None`` (``session.pull(module, grads=True)`` fetches
    them). Gradients that autograd did leave locally (parameters used by local
    code) are moved to the worker before ``step()`` and ``clip_grad_norm_()``.
    """

    def __init__(self, optimizer_class: type[torch.optim.Optimizer], params, *, session=None,
                 **hyperparameters) -> None:
        name = getattr(optimizer_class, "__name__", "")
        if getattr(torch.optim, name, None) is not optimizer_class or optimizer_class is torch.optim.Optimizer:
            raise TypeError(f"{optimizer_class!r} is not an optimizer class of torch.optim")
        # the class's own defaults, complete, so schedulers find every key (lr, betas, …)
        defaults = optimizer_class([torch.zeros(1, requires_grad=True)], **hyperparameters).defaults
        super().__init__(params, dict(defaults))
        self.optimizer_class = optimizer_class
        params_all = [p for g in self.param_groups for p in g["params"]]
        self.session = session if session is not None else self._session_of(params_all)
        self._client = training_client(self.session)
        self._sent = [self._hyper(g) for g in self.param_groups]
        with self.session._lock:
            self._client.bind_stale(params_all)
            self._id = self._client.new_optim_id()
            groups = [[self._client.slots.lookup(p) for p in g["params"]] for g in self.param_groups]
            self._client.request(m.OptimCreate(self._id, name, [[slot.sid for slot in g] for g in groups],
                                               self._sent))
            for group in groups:
                for slot in group:
                    slot.optims.add(self._id)
        weakref.finalize(self, self._client.drop_optim, self._id)

    @staticmethod
    def _session_of(params: list):
        from ..client.session import default_session
        owners = {id(o): o for o in (owner_of(p) for p in params) if o is not None and not o._closed}
        if len(owners) > 1:
            raise ForeignParameterError("these parameters are held by different sessions")
        return next(iter(owners.values())) if owners else default_session()

    @staticmethod
    def _hyper(group: dict) -> dict:
        return {k: _plain(k, v) for k, v in group.items() if k != "params"}

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_id", None) is not None:
            raise NotImplementedError("RemoteOptimizer: parameter groups cannot be added after creation")
        super().add_param_group(param_group)

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _prepare(self) -> list[torch.Tensor]:
        """Parameters changed locally are re-sent, local gradients moved to the worker.

        Returns the parameters that had local gradients: local code uses them,
        so after a step their new values are brought back.
        """
        params = self._params()
        self._client.bind_stale(params)
        return self._client.push_local_grads(params)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        """Run ``step()`` on the worker, with the hyperparameters that changed since the last one.

        A closure is called here first (it typically runs forward and
        backward, remotely) and its result returned; optimizers that call
        the closure several times per step (LBFGS) are not supported.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        hyper = [self._hyper(g) for g in self.param_groups]
        changed = [{k: v for k, v in h.items() if sent.get(k, _MISSING) != v}
                   for h, sent in zip(hyper, self._sent)]
        while changed and not changed[-1]:
            changed.pop()
        s = self.session
        with s._lock:
            used_locally = self._prepare()
            self._client.request(m.OptimStep(self._id, changed))
            for p in self._params():
                slot = self._client.slots.lookup(p)
                if slot is not None:
                    slot.stepped = True
            if used_locally:
                self._client.pull_tensors(used_locally)
        self._sent = hyper
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients on the worker (and any local ones).

        ``set_to_none=True`` (the default) costs no round trip: it rides on
        the next request to the worker, which runs it before anything else.
        """
        for p in self._params():
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()
        s = self.session
        with s._lock:
            if set_to_none:
                self._client.defer_zero_grad(self._id)
            else:
                self._client.request(m.OptimZeroGrad(self._id, False))

    def state_dict(self) -> dict:
        """PyTorch's optimizer ``state_dict()``, with the per-parameter state fetched from the worker."""
        sd = super().state_dict()
        with self.session._lock:
            reply, frames = self._client.request(m.OptimGetState(self._id))
        if not isinstance(reply, m.OptimStateReply):
            raise ProtocolError("worker answered optimizer state with the wrong reply")
        state: dict[int, dict] = {}
        for idx, key, value in reply.entries:
            state.setdefault(idx, {})[key] = (tensor_from_wire(value.meta, frames[value.meta.frame]).clone()
                                              if isinstance(value, m.TensorArg) else value.value)
        sd["state"] = state
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load hyperparameters here and per-parameter state into the worker's optimizer."""
        super().load_state_dict(state_dict)
        index = {id(p): i for i, p in enumerate(self._params())}
        entries, frames = [], []
        for p, per_param in self.state.items():
            for key, value in per_param.items():
                if isinstance(value, torch.Tensor):
                    meta, buf = tensor_to_wire(value, len(frames))
                    entries.append((index[id(p)], key, m.TensorArg(meta)))
                    frames.append(buf)
                elif value is None or isinstance(value, (bool, int, float)):
                    entries.append((index[id(p)], key, m.ScalarArg(value)))
                else:
                    raise TypeError(f"optimizer state {key!r} of type {type(value).__name__} cannot "
                                    "travel to the worker")
        self.state.clear()  # the state lives on the worker
        with self.session._lock:
            self._client.request(m.OptimSetState(self._id, entries), frames)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over this optimizer's parameters, on the worker.

        Returns the total norm of the gradients before clipping, as a 0-d tensor.
        """
        s = self.session
        with s._lock:
            self._prepare()
            reply, _ = self._client.request(m.ClipGradNorm(self._id, float(max_norm), float(norm_type),
                                                 bool(error_if_nonfinite)))
        if not isinstance(reply, m.NormReply):
            raise ProtocolError("worker answered clip_grad_norm_ with the wrong reply")
        return torch.tensor(reply.norm)

    def __repr__(self) -> str:
        return f"RemoteOptimizer({self.optimizer_class.__name__}, groups={len(self.param_groups)})"


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

from ..client import origin
from ..client.placeholders import fill, placeholder
from ..client.launched import Launched
from ..client.session import default_session
from ..codec import messages as m
from ..codec.frames import SCALARS, FrameReader, FrameWriter
from ..errors import ForeignParameterError, ProtocolError
from . import clip
from .client import TrainingClient
from .params import owner_of_live, wait_for_binding

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
    takes. The session is ``session``; without it, the session whose worker
    holds the parameters, or, when none does yet, the session of the first
    compiled forward that uses them (so ``RemoteOptimizer`` may be made
    before the first forward without naming the session); a ``step()``
    before any forward binds it to the default session. Parameters held by
    another session raise :class:`~remotorch.errors.ForeignParameterError`.

    Gradients live on the worker: after ``loss.backward()`` the local
    ``p.grad`` stays ``None`` (``session.pull(module, grads=True)`` fetches
    them). Gradients that autograd did leave locally (parameters used by local
    code) are moved to the worker before ``step()`` and ``clip_grad_norm_()``;
    ``torch.nn.utils.clip_grad_norm_`` over its parameters clips on the worker
    too (:mod:`remotorch.training.clip`).
    """

    runs_remotely = True  # its step() changes the worker's values, not the local ones (training/writes.py)

    def __init__(self, optimizer_class: type[torch.optim.Optimizer], params, *, session=None,
                 client: TrainingClient | None = None, **hyperparameters) -> None:
        name = getattr(optimizer_class, "__name__", "")
        if getattr(torch.optim, name, None) is not optimizer_class or optimizer_class is torch.optim.Optimizer:
            raise TypeError(f"{optimizer_class!r} is not an optimizer class of torch.optim")
        # the class's own defaults, complete, so schedulers find every key (lr, betas, …)
        defaults = optimizer_class([torch.zeros(1, requires_grad=True)], **hyperparameters).defaults
        super().__init__(params, dict(defaults))
        self.optimizer_class = optimizer_class
        self._client: TrainingClient | None = None
        self._id: int | None = None
        self._sent = [self._hyper(g) for g in self.param_groups]
        clip.manage(self, self._params())  # torch.nn.utils.clip_grad_norm_ over them clips on the worker
        if client is None:  # ``client``: a given worker's training client (a pipeline's, a replica's)
            client = session.trainer() if session is not None else _holder(self._params())
        if client is not None:
            self.bind(client)
        else:  # bound by the first session that puts one of these parameters in a slot
            for p in self._params():
                wait_for_binding(p, self)

    @property
    def bound(self) -> bool:
        """True once the optimizer exists on a worker."""
        return self._client is not None

    def bind(self, client: TrainingClient) -> None:
        """Create the optimizer on ``client``'s worker over its parameters' slots (once)."""
        if self._client is not None:
            if client is not self._client:
                raise ForeignParameterError("this optimizer's parameters are used by different sessions")
            return
        params = self._params()
        with client.connection.lock:
            self._client = client  # first: binding the slots below may come back here
            try:
                client.bind_stale(params)
                oid = client.new_optim_id()
                groups = [[client.slots.lookup(p) for p in g["params"]] for g in self.param_groups]
                client.post(m.OptimCreate(oid, self.optimizer_class.__name__,
                                          [[slot.sid for slot in g] for g in groups], self._sent),
                            what=f"creating {self.optimizer_class.__name__} on the worker")
            except BaseException:
                self._client = None
                raise
            self._id = oid
            client.optimizers.add(self)
            for group in groups:
                for slot in group:
                    slot.optims.add(oid)
            weakref.finalize(self, client.drop_optim, oid)
            if self.state:  # loaded before the optimizer had a worker
                self._send_state()

    def _bound(self) -> TrainingClient:
        """The training client, binding to the parameters' session (or the default one) first if needed."""
        if self._client is None:
            self.bind(_holder(self._params()) or default_session().trainer())
        return self._client

    @staticmethod
    def _hyper(group: dict) -> dict:
        return {k: _plain(k, v) for k, v in group.items() if k != "params"}

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_sent", None) is not None:
            raise NotImplementedError("RemoteOptimizer: parameter groups cannot be added after creation")
        super().add_param_group(param_group)

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _prepare(self, client: TrainingClient) -> list[torch.Tensor]:
        """Parameters changed locally are re-sent, local gradients moved to the worker.

        Returns the parameters that had local gradients: local code uses them,
        so after a step their new values are brought back.
        """
        params = self._params()
        client.bind_stale(params)
        return client.push_local_grads(params)

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
        client = self._bound()
        hyper = [self._hyper(g) for g in self.param_groups]
        changed = [{k: v for k, v in h.items() if sent.get(k, _MISSING) != v}
                   for h, sent in zip(hyper, self._sent)]
        while changed and not changed[-1]:
            changed.pop()
        with client.connection.lock:
            used_locally = self._prepare(client)
            client.post(m.OptimStep(self._id, changed), what=f"{self.optimizer_class.__name__}.step()", step=True)
            for p in self._params():
                slot = client.slots.lookup(p)
                if slot is not None:
                    slot.stepped = True
            if used_locally:
                client.pull_tensors(used_locally)
        self._sent = hyper
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients on the worker (and any local ones).

        ``set_to_none=True`` (the default) costs no round trip: it rides on
        the next request to the worker, which runs it before anything else.
        Before the optimizer has a worker there is nothing remote to clear.
        """
        for p in self._params():
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()
        client = self._client
        if client is None:
            return
        with client.connection.lock:
            if set_to_none:
                client.defer_zero_grad(self._id)
            else:
                client.post(m.OptimZeroGrad(self._id, False), what=f"{self.optimizer_class.__name__}.zero_grad()")

    def state_dict(self) -> dict:
        """PyTorch's optimizer ``state_dict()``, with the per-parameter state fetched from the worker."""
        sd = super().state_dict()
        client = self._client
        if client is None:
            return sd  # no worker yet: the state (if loaded) is still here
        with client.connection.lock:
            reply, frames = client.request(m.OptimGetState(self._id))
        if not isinstance(reply, m.OptimStateReply):
            raise ProtocolError("worker answered optimizer state with the wrong reply")
        reader, state = FrameReader(frames), {}
        for idx, key, value in reply.entries:
            v = reader.value(value)
            state.setdefault(idx, {})[key] = v.clone() if isinstance(v, torch.Tensor) else v
        sd["state"] = state
        return sd

    def take_state(self) -> None:
        """Bring the worker's state here and let go of the worker (its session is ending).

        ``state_dict()`` keeps answering from the local copy, and the next
        session that puts these parameters in slots creates the optimizer
        there again, with this state.
        """
        if self._client is None:
            return
        state, params = self.state_dict()["state"], self._params()
        self.state.clear()
        for idx, per_param in state.items():
            self.state[params[idx]] = per_param
        self._client, self._id = None, None
        for p in params:
            wait_for_binding(p, self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load hyperparameters here and per-parameter state into the worker's optimizer."""
        super().load_state_dict(state_dict)
        if self._client is None:  # created on a worker later, with these hyperparameters and state
            self._sent = [self._hyper(g) for g in self.param_groups]
        else:
            self._send_state()

    def took_hyperparameters(self, hyper: list[dict]) -> None:
        """The worker's optimizer took these hyperparameters (one map per group, from a checkpoint)."""
        for group, h in zip(self.param_groups, hyper):
            group.update({k: tuple(v) if isinstance(v, list) else v for k, v in h.items()})
        self._sent = [self._hyper(g) for g in self.param_groups]

    def _send_state(self) -> None:
        index = {id(p): i for i, p in enumerate(self._params())}
        w, entries = FrameWriter(), []
        for p, per_param in self.state.items():
            for key, value in per_param.items():
                if not isinstance(value, (torch.Tensor, *SCALARS)):
                    raise TypeError(f"optimizer state {key!r} of type {type(value).__name__} cannot "
                                    "travel to the worker")
                entries.append((index[id(p)], key, w.value(value)))
        client = self._client
        with client.connection.lock:
            client.post(m.OptimSetState(self._id, entries), w.frames, what="loading optimizer state")
        self.state.clear()  # the state lives on the worker

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over this optimizer's parameters, on the worker.

        Returns the total norm of the gradients before clipping, as a 0-d tensor
        that stands here at once: nothing waits for the worker unless it is read.
        """
        client = self._bound()
        conn = client.connection
        with conn.lock:
            self._prepare(client)
            made = []

            def take(reply, _frames) -> None:
                if made and "_rt_ref" in made[0].__dict__:
                    fill(made[0], torch.tensor(reply.norm))

            launched = Launched("clip_grad_norm_", take, m.NormReply, origin=origin.here())
            made.append(placeholder(conn, m.KeptArg(0, "float32", [], []), None, launched=launched))
            conn.link.launch(m.ClipGradNorm(self._id, float(max_norm), float(norm_type), bool(error_if_nonfinite)),
                             (), launched)
        return made[0]

    def __repr__(self) -> str:
        return f"RemoteOptimizer({self.optimizer_class.__name__}, groups={len(self.param_groups)})"


def _holder(params: list):
    """The training client whose worker holds these parameters now, or None; several: an error."""
    owners = {id(o): o for o in (owner_of_live(p) for p in params) if o is not None}
    if len(owners) > 1:
        raise ForeignParameterError("these parameters are held by different sessions")
    return next(iter(owners.values()), None)

"""One optimizer per stage worker, seen as one ``torch.optim.Optimizer``.

``pipe.optimizer(torch.optim.AdamW, lr=1e-3)`` returns a
:class:`PipelineOptimizer`: its ``param_groups`` (one group, every
parameter of the model the pipeline trains) are what schedulers change; each
``step()`` hands the group's hyperparameters to a
:class:`~remotorch.training.optim.RemoteOptimizer` per worker (over the
parameters of that worker's stages) and steps them all, in parallel. Their
state stays on the workers; ``state_dict()`` gathers it by parameter name.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..client.pool import run_all
from ..training.optim import RemoteOptimizer


class PipelineOptimizer(torch.optim.Optimizer):
    """``optimizer_class`` on every worker of a pipeline; made per worker after the pipeline's first step."""

    def __init__(self, pipe, optimizer_class: type[torch.optim.Optimizer], **hyperparameters) -> None:
        defaults = optimizer_class([torch.zeros(1, requires_grad=True)], **hyperparameters).defaults
        params = [p for p in pipe.model.parameters() if p.requires_grad]
        super().__init__(params, dict(defaults))
        self.pipe = pipe
        self.optimizer_class = optimizer_class
        self.hyperparameters = hyperparameters
        self.parts: list[tuple[list[str], RemoteOptimizer]] = []
        self.mirrors: list[list[tuple[list[str], RemoteOptimizer]]] = []  # the other replicas', in the same order
        self._loaded: dict | None = None

    def _parts(self) -> list[tuple[list[str], RemoteOptimizer]]:
        """Replica 0's optimizers (one per worker): their state is the optimizer's state."""
        if not self.parts and self.pipe.layout is not None:
            for r, parts in enumerate(self.pipe.replica_parts()):
                made = []
                for client, named in parts:
                    if not named:
                        continue
                    opt = RemoteOptimizer(self.optimizer_class, [p for _, p in named], client=client,
                                          **self.hyperparameters)
                    made.append(([n for n, _ in named], opt))
                if r == 0:
                    self.parts.extend(made)
                else:
                    self.mirrors.append(made)
            if self._loaded is not None:
                self._load_parts(self._loaded)
                self._loaded = None
        return self.parts

    def _all(self) -> list[tuple[list[str], RemoteOptimizer]]:
        """Every replica's optimizers (replicas step alike: equal gradients, equal state)."""
        parts = self._parts()
        return parts + [p for made in self.mirrors for p in made]

    def _sync(self) -> None:
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        for _, opt in self._all():
            opt.param_groups[0].update(group)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        """Step every worker's optimizer (in parallel) with this optimizer's hyperparameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync()
        run_all([opt.step for _, opt in self._all()])
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for _, opt in self._all():
            opt.zero_grad(set_to_none)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``clip_grad_norm_`` over all stages: the total norm from each worker's, then one scale for all.

        Replicas hold equal gradients (averaged after each step), so replica 0's give the norm.
        """
        parts = self._parts()
        norms = run_all([lambda o=opt: o.clip_grad_norm_(float("inf"), norm_type) for _, opt in parts])
        total = torch.linalg.vector_norm(torch.stack(norms), norm_type) if norms else torch.tensor(0.0)
        coef = max_norm / (float(total) + 1e-6)
        if coef < 1.0:
            run_all([lambda o=opt, n=n: o.clip_grad_norm_(float(n) * coef, norm_type)
                     for made in (parts, *self.mirrors) for (_, opt), n in zip(made, norms)])
        return total

    def state_dict(self) -> dict:
        """Hyperparameters, and each parameter's optimizer state under its qualified name."""
        state = {}
        for names, opt in self._parts():
            sd = opt.state_dict()
            for idx, per_param in sd["state"].items():
                state[names[idx]] = per_param
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        if self._parts():
            self._load_parts(state_dict)
        else:
            self._loaded = state_dict

    def _load_parts(self, state_dict: dict) -> None:
        self._sync()
        for names, opt in self._all():
            sd = opt.state_dict()
            sd["state"] = {i: state_dict["state"][n] for i, n in enumerate(names) if n in state_dict["state"]}
            sd["param_groups"][0].update({k: v for k, v in self.param_groups[0].items() if k != "params"})
            opt.load_state_dict(sd)

    def __repr__(self) -> str:
        return (f"PipelineOptimizer({self.optimizer_class.__name__}, workers={len(self.parts)}, "
                f"replicas={1 + len(self.mirrors)})")

"""``Pipeline``: train a model split into stages on several workers, with any schedule.

::

    pipe = pipeline.Pipeline(model, split_before=["layers.4"], session=s, schedule="1F1B",
                             microbatches=8, loss_fn=loss_fn)
    opt = pipe.optimizer(torch.optim.AdamW, lr=1e-3)
    loss = pipe.step(x, y); opt.step(); opt.zero_grad()
    pipe.pull(model)

The first ``step`` traces ``loss_fn(model(*x), y)`` on one microbatch as
one graph, splits it (:mod:`.split`), uploads each stage's graphs to its
worker (stage i on worker i mod W) and puts its parameters in slots there.
Every step then runs the schedule (:mod:`.runtime`): the client sends each
microbatch's leaves to the stages that take them and receives the losses;
activations and gradients go worker to worker.

``replicas=R`` trains R copies of the stages on R sets of workers (data x
pipeline parallelism, :mod:`remotorch.pipeline.replicas`): each step splits
the batch into R equal shards, runs them at once, and averages each stage's
gradients across its replicas, worker to worker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch
import torch.utils._pytree as pytree

from .. import errors
from ..client.session import Session, default_session
from ..client.pool import run_all
from .replicas import Column, each_column
from .optim import PipelineOptimizer
from .runtime import StageLayout, StepRun
from .split import Split, split_model
from .stage import StageRunner
from ..client.rng import GENERATORS

log = logging.getLogger(__name__)


class Pipeline:
    """A model cut before the submodules ``split_before`` names, trained stage by stage on the session's workers.

    ``schedule`` is a name (``"GPipe"``, ``"1F1B"``, ``"Interleaved1F1B"``)
    or a :class:`~remotorch.pipeline.schedules.Schedule` written by hand;
    ``loss_fn(output, target)`` runs on the last stage for each microbatch,
    and a step's gradients are those of the mean loss over the whole batch.

    ``workers`` picks the session's workers to use (indices or names; default
    all). ``replicas`` > 1 splits them into that many equal sets, one replica
    of the stages each; a batch must then split into ``replicas`` x
    ``microbatches`` equal parts (an uneven batch is refused, not weighted).
    ``group_timeout`` bounds forming the replicas' groups and each
    collective (seconds); ``bucket_mb`` is the all-reduce bucket size.
    ``overlap``: start averaging a stage's gradients as soon as its last
    backward of the step ran, while earlier stages still compute (default:
    each replica starts all of its stages' averaging once its backward is
    done, without waiting for the other replicas; ``benchmarks/data_parallel.py``
    measures both).

    ``weights`` (``ROOT/path`` under a worker's ``--weights`` root, at
    ``revision`` for a hub cache) with a model built on meta
    (:func:`remotorch.init_empty_weights`): each worker reads from its own disk
    only its stages' tensors (``weights_read`` says how many bytes each read),
    and nothing of the weights goes through this process.
    """

    def __init__(self, model: torch.nn.Module, split_before: Sequence[str], *, loss_fn: Callable,
                 session: Session | None = None, schedule="1F1B", microbatches: int = 4,
                 engine: str = "eager", replicas: int = 1, workers: Sequence[int | str] | None = None,
                 group_timeout: float = 60.0, bucket_mb: float = 25.0, overlap: bool = False,
                 weights: str | None = None, revision: str | None = None) -> None:
        if microbatches < 1:
            raise ValueError("microbatches must be at least 1")
        if not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"replicas must be an int >= 1, got {replicas!r}")
        if isinstance(split_before, str):
            split_before = [split_before]
        self.model = model
        self.split_before = list(split_before)
        self.loss_fn = loss_fn
        self.session = session if session is not None else default_session()
        self.schedule_spec = schedule
        self.microbatches = microbatches
        self.engine = engine
        self.replicas = replicas
        self.workers = None if workers is None else list(workers)
        self.group_timeout = group_timeout
        self.bucket_bytes = max(1, int(bucket_mb * (1 << 20)))
        self.overlap = overlap
        self.weights, self.revision = weights, revision  # each worker reads its stages' part of these files
        self.weights_read: dict[str, int] = {}  # bytes of weights each worker read for its stages
        self.replica_layouts: list[StageLayout] = []  # replica r's stages (layout is replica 0's)
        self.columns: list[Column] = []  # worker w of every replica, and its group
        self.generation = 0
        # seconds of the last step: all of it (step_s) and, with replicas, averaging the gradients (reduce_s)
        self.last_timing: dict[str, float] = {}
        self.schedule = None
        self.split: Split | None = None
        self.layout: StageLayout | None = None
        self._shapes = None
        self._optimizer: PipelineOptimizer | None = None
        self.last_step: StepRun | None = None

    @property
    def num_stages(self) -> int:
        return len(self.split_before) + 1

    # ------------------------------------------------------------------- build
    def _chunks(self, x, y) -> tuple[list, list]:
        args = x if isinstance(x, (tuple, dict)) else (x,)  # positional arguments, or keyword ones
        leaves, spec = pytree.tree_flatten((args, y))
        n = self.microbatches * self.replicas
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        if not tensors:
            raise TypeError("pipe.step takes tensors: the model's inputs and the target")
        batch = tensors[0].shape[0] if tensors[0].dim() else 0
        for t in tensors:
            if t.dim() == 0 or t.shape[0] != batch:
                raise ValueError("every input and the target must share the batch dimension (dim 0)")
        if batch % n:
            shards = f"{self.replicas} replicas x {self.microbatches}" if self.replicas > 1 else f"{n}"
            raise ValueError(f"a batch of {batch} does not split into {shards} equal microbatches "
                             "(uneven shards are refused rather than weighted)")
        per = [t.chunk(n) for t in tensors]
        mbs = []
        for i in range(n):
            it = iter(p[i] for p in per)
            mbs.append(pytree.tree_unflatten([next(it) if isinstance(v, torch.Tensor) else v for v in leaves], spec))
        return mbs, [(tuple(t.shape[1:]), t.dtype) for t in tensors]

    def _conns(self) -> list:
        conns = self.session.connections()
        if self.workers is None:
            return conns
        chosen = [self.session.connection_for(w) for w in self.workers]
        if len({id(c) for c in chosen}) != len(chosen):
            raise ValueError(f"workers={self.workers!r} names a worker twice")
        return chosen

    def _build(self, first) -> None:
        args, target = first
        if self.weights is not None:
            from ..weights.stages import traceable

            traceable(self.model)  # a model on meta: traced with tensors that hold nothing
        self.split = split_model(self.model, self.loss_fn, self.split_before, args, target)
        conns = self._conns()
        if len(conns) < self.replicas:
            raise ValueError(f"{self.replicas} replicas need at least {self.replicas} workers; "
                             f"{len(conns)} are given")
        if len(conns) % self.replicas:
            raise ValueError(f"{len(conns)} workers do not split into {self.replicas} equal replicas")
        workers = min(len(conns) // self.replicas, self.num_stages)
        self.schedule = self._make_schedule(workers)
        placement = tuple(self.schedule.placement)
        self.replica_layouts = []
        for r in range(self.replicas):
            mine = conns[r * workers:(r + 1) * workers]
            runners = [StageRunner(stage, self.session.trainer(mine[placement[stage.index]]), self.engine)
                       for stage in self.split.stages]
            self.replica_layouts.append(StageLayout(runners, placement, [c.url or "" for c in mine]))
        self.layout = self.replica_layouts[0]
        if self.weights is not None:
            from ..weights.stages import load_stages

            self.weights_read = load_stages(self.session, self.weights, self.revision, self.model, self.split,
                                            self.replica_layouts)
        for r in self.layout.runners:
            r.bind()
        if self.replicas > 1:
            self._form_groups()
        log.info("pipeline: %d stages on %d workers x %d replicas, schedule %s", self.num_stages, workers,
                 self.replicas, self.schedule.name)

    def _form_groups(self) -> None:
        """One group per worker column; then every replica takes replica 0's parameters."""
        self.generation += 1
        self.columns = []
        for w in range(len(self.layout.urls)):
            clients = [layout.runners[next(r.index for r in layout.runners if layout.placement[r.index] == w)].client
                       for layout in self.replica_layouts]
            params = list({id(p): p for r in self.layout.runners if self.layout.placement[r.index] == w
                           for p in r.params}.values())
            self.columns.append(Column(clients, params, timeout_s=self.group_timeout, generation=self.generation))
        each_column(self.columns, Column.sync)

    def _start_reduce(self, replica: int) -> Callable[[int], None] | None:
        """With ``overlap``: what replica ``replica`` does once a stage's gradients are final."""
        if not self.overlap or self.replicas == 1:
            return None
        return lambda stage: self._start_stage(replica, stage)

    def _start_stage(self, replica: int, stage: int) -> None:
        """Replica ``replica``'s worker for ``stage`` starts averaging the stage's gradients and answers."""
        layout = self.replica_layouts[replica]
        params = layout.runners[stage].params
        if params:
            self.columns[layout.placement[stage]].start(replica, params, self.bucket_bytes)

    def _replica_step(self, replica: int, run: StepRun, ended: list) -> torch.Tensor:
        """One replica's forward and backward, then (unless ``overlap`` started them stage by stage)
        its reductions, started from its own thread at once: the last replica to finish its
        backward starts the collectives, with no wait for the client to gather the others."""
        loss = run.run()
        ended.append(time.perf_counter())
        if not self.overlap:
            for stage in range(self.num_stages):
                self._start_stage(replica, stage)
        return loss

    def _make_schedule(self, workers: int):
        from . import builders, schedules
        spec = self.schedule_spec
        if isinstance(spec, str):
            chunks = self.num_stages // workers if "interleaved" in spec.lower() else 1
            if "interleaved" in spec.lower() and self.num_stages % workers:
                raise ValueError(f"{spec} needs the stages ({self.num_stages}) to be a multiple of the "
                                 f"workers ({workers})")
            sched = builders.build(spec, self.num_stages, self.microbatches, chunks=chunks, workers=workers)
        else:
            sched = spec
        schedules.validate(sched)
        if sched.stages != self.num_stages or sched.microbatches != self.microbatches:
            raise ValueError(f"the schedule is for {sched.stages} stages x {sched.microbatches} microbatches; "
                             f"this pipeline has {self.num_stages} x {self.microbatches}")
        if sched.workers > workers:
            raise ValueError(f"the schedule uses {sched.workers} workers; this pipeline has {workers} "
                             "per replica")
        return sched

    # -------------------------------------------------------------------- step
    def step(self, x, y) -> torch.Tensor:
        """Forward and backward of every microbatch (gradients accumulate on the workers); the mean loss.

        ``x`` is the model's input: a tensor, a tuple of positional arguments or a dict of keyword
        arguments (``{"input_ids": …, "attention_mask": …}``); ``y`` the target ``loss_fn`` takes.
        Every tensor in them is split along dimension 0 into the microbatches.
        """
        mbs, shapes = self._chunks(x, y)
        if self.layout is None:
            self._build(mbs[0])
            self._shapes = shapes
        elif shapes != self._shapes:
            raise ValueError(f"microbatch shapes changed from {self._shapes} to {shapes}: a pipeline is "
                             "traced for one shape (make a new Pipeline for another)")
        for r in self.layout.runners:
            r.bind()  # parameters changed here since (load_state_dict, a local edit) go up first
        runners = [r for layout in self.replica_layouts for r in layout.runners]
        if any(r.forward_graph.random or r.backward_graph.random for r in runners):
            # each worker's random graphs draw from a stream of its own, seeded from this process's generator
            GENERATORS.fork(list({id(r.conn.link): r.conn.link for r in runners}.values()))
        if self.columns:
            each_column(self.columns, Column.sync)  # and from replica 0 to the others
        n_args = self.split.n_inputs
        leaves, targets = [], []
        for args, target in mbs:
            flat = [t for t in pytree.tree_leaves((args, target)) if isinstance(t, torch.Tensor)]
            leaves.append(flat[:n_args])
            targets.append(flat[n_args:])
        n = self.microbatches
        # with replicas, each seeds its backward with 1/R of its mean loss's gradient, so the sum the
        # all-reduce makes is the mean over the whole batch (no scaling pass over the gradients)
        runs = [StepRun(layout, self.schedule, leaves[r * n:(r + 1) * n], targets[r * n:(r + 1) * n],
                        loss_scale=1.0 / self.replicas, grads_done=self._start_reduce(r))
                for r, layout in enumerate(self.replica_layouts)]
        self.last_step = runs[0]
        started = time.perf_counter()
        if len(runs) == 1:
            loss = runs[0].run()
            self.last_timing = {"step_s": time.perf_counter() - started}
            return loss
        backwards_ended: list[float] = []
        try:
            losses = run_all([lambda r=r, run=run: self._replica_step(r, run, backwards_ended)
                              for r, run in enumerate(runs)])
        except BaseException:  # reductions may have started on some replicas only: those groups are done for
            for col in self.columns:
                col.group.broken = col.group.broken or errors.GroupError("a step failed mid-way")
            raise
        each_column(self.columns, lambda col: col.finish())
        ended = time.perf_counter()
        # the time averaging added to the step: from the last replica's backward to every reduction done
        self.last_timing = {"step_s": ended - started, "reduce_s": ended - max(backwards_ended)}
        return torch.stack([torch.as_tensor(x) for x in losses]).mean()

    def last_timeline(self) -> dict:
        """When each action of the last step ran, as the client saw it (request sent to reply read).

        ``{"actions": [(worker, "0F1", start_s, end_s)], "total": s, "bubble_fraction": f}``, times
        from the step's start; the bubble is the time workers spent without a request in flight
        over workers x the step's duration (what :func:`~remotorch.pipeline.simulate.simulate`
        predicts for the same schedule).
        """
        run = self.last_step
        if run is None:
            raise RuntimeError("no step has run yet")
        total = run.ended - run.started
        busy = sum(t1 - t0 for _, _, t0, t1 in run.timeline)
        workers = self.schedule.workers
        return {"actions": sorted((w, str(a), t0 - run.started, t1 - run.started)
                                  for w, a, t0, t1 in run.timeline),
                "total": total, "bubble_fraction": 1.0 - busy / (workers * total) if total > 0 else 0.0}

    # ---------------------------------------------------------- optimizer etc.
    def optimizer(self, optimizer_class: type[torch.optim.Optimizer], **hyperparameters) -> PipelineOptimizer:
        """One ``optimizer_class`` per worker over its stages' parameters, as one ``torch.optim.Optimizer``."""
        self._optimizer = PipelineOptimizer(self, optimizer_class, **hyperparameters)
        return self._optimizer

    def parameters_by_worker(self) -> list[tuple[object, list[tuple[str, torch.Tensor]]]]:
        """(training client, [(name, parameter)]) per worker that holds stages (after the first step)."""
        if self.layout is None:
            return []
        names = {id(p): n for n, p in self.model.named_parameters()}
        by_client: dict[int, tuple] = {}
        for r in self.layout.runners:
            entry = by_client.setdefault(id(r.client), (r.client, []))
            entry[1].extend((names[id(p)], p) for p in r.params)
        return list(by_client.values())

    def replica_parts(self) -> list[list[tuple[object, list[tuple[str, torch.Tensor]]]]]:
        """:meth:`parameters_by_worker` of every replica, replica 0 first (the same names, in order)."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        out = []
        for layout in self.replica_layouts:
            by_client: dict[int, tuple] = {}
            for r in layout.runners:
                entry = by_client.setdefault(id(r.client), (r.client, []))
                entry[1].extend((names[id(p)], p) for p in r.params)
            out.append(list(by_client.values()))
        return out

    def pull(self, model: torch.nn.Module | None = None) -> int:
        """Bring the workers' parameters of record back into ``model`` (default: the pipeline's own).

        With replicas, from replica 0 (every replica holds the same values).
        """
        count = 0
        for client, named in self.parameters_by_worker():
            count += client.pull_tensors([p for _, p in named])
        for col in self.columns:
            col.mirrored()
        if model is not None and model is not self.model:
            own = dict(self.model.named_parameters())
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name in own:
                        p.copy_(own[name])
        return count

    def state_dict(self) -> dict:
        """Parameters (by qualified name) and optimizer state of every stage, for a checkpoint."""
        self.pull()
        return {"model": {n: p.detach().clone() for n, p in self.model.named_parameters()},
                "optimizer": self._optimizer.state_dict() if self._optimizer is not None else None}

    def load_state_dict(self, state: dict) -> None:
        """Restore a checkpoint: parameters go up with the next step, optimizer state now (or at binding)."""
        own = dict(self.model.named_parameters())
        missing = sorted(set(own) - set(state["model"]))
        if missing:
            raise KeyError(f"checkpoint lacks parameters {missing[:5]}")
        with torch.no_grad():
            for name, value in state["model"].items():
                own[name].copy_(value)
        if state.get("optimizer") is not None:
            if self._optimizer is None:
                raise RuntimeError("make the optimizer (pipe.optimizer(...)) before loading its state")
            self._optimizer.load_state_dict(state["optimizer"])

    def __repr__(self) -> str:
        return (f"Pipeline(stages={self.num_stages}, microbatches={self.microbatches}, "
                f"schedule={getattr(self.schedule, 'name', self.schedule_spec)!r})")

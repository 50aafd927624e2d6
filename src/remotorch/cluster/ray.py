"""remotorch workers inside Ray actors: Ray places them, gives them GPUs and restarts them.

:class:`RayCluster` reserves one placement group for the whole cluster (one
bundle per worker, all or nothing), starts N Ray actors
(:class:`~remotorch.cluster.actor.WorkerActor`) on its bundles, each of which
*is* a remotorch worker bound to its node's address with a token shared by
the cluster, and offers a :class:`remotorch.Session` over all of them. Ray is
used for placement and lifecycle only: tensors never go through Ray's object
store or its direct transport; clients and workers talk remotorch's own
authenticated protocol, worker to worker included (a worker reaches a peer
at the URL the session knows it by, which is the peer's node address).

Failures are Ray's to see: a worker's death is its actor's, Ray restarts
the actor (``max_restarts``) on the same bundle with a fresh worker on a new
port. The cluster keeps one call waiting on each actor (``watch``), which Ray
fails when the actor dies; the next use of :attr:`RayCluster.session` then
re-reads the workers' URLs (waiting for restarting actors) and gives a new
session over the new set. :meth:`RayCluster.refresh` does the same on
demand, :meth:`RayCluster.restart` replaces one worker's actor with a fresh
one. Errors are read from Ray's exception types and ``RayTaskError.cause``,
never from their text.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Mapping, Sequence

from ..client.session import Session
from ..errors import PlacementError, RemoteError, WorkerUnavailableError
from .actor import WorkerActor

log = logging.getLogger(__name__)


def _ray():
    """The ``ray`` module, or an ImportError that says how to get it."""
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - ray is part of the test extra
        raise ImportError("remotorch.cluster.RayCluster needs Ray: pip install 'remotorch[ray]'") from exc
    return ray


class RayCluster:
    """``num_workers`` remotorch workers in Ray actors, and a :class:`remotorch.Session` over them.

    A context manager: entering reserves the workers' resources and starts
    them (and Ray, if this process has not initialised it), leaving closes
    the session, ends every worker and its actor, releases the reservation,
    and shuts Ray down only if it started it.

    ``address``: ``None`` starts a local Ray (dashboard off unless
    ``ray_init_kwargs`` say otherwise); ``"auto"`` or ``"ray://…"``/``"host:port"``
    joins an existing cluster. If Ray is already initialised in this process,
    it is used as it is.

    Each worker reserves ``num_cpus_per_worker`` CPUs and ``num_gpus_per_worker``
    GPUs, as one bundle of a placement group that holds the whole cluster
    (``placement_strategy``: ``"PACK"``, ``"SPREAD"``, ``"STRICT_PACK"`` or
    ``"STRICT_SPREAD"``, Ray's meanings), so the workers start together or
    not at all. A cluster whose request exceeds what the Ray cluster has in
    total fails at once with :class:`~remotorch.errors.PlacementError`
    naming what is missing; one that fits in total but not now (other work
    holds the resources) waits up to ``placement_timeout`` seconds, then
    fails the same way. ``wait_for_resources=True`` skips the at-once check,
    for an autoscaling cluster that adds nodes on demand. Ray sets
    ``CUDA_VISIBLE_DEVICES``; the worker runs on ``cuda`` when it has a GPU
    and on ``cpu`` otherwise, unless ``device`` says, with as many threads as
    CPUs it reserved (at least one).

    ``engines`` limits the worker engines (``remotorch serve --engines``),
    ``serve_args`` passes further ``remotorch serve`` options
    (``--memory-quota 8G``, ``--tls-cert …`` with paths valid on every node),
    ``actor_options`` further Ray actor options (``resources``,
    ``runtime_env``…; a ``scheduling_strategy`` of one's own replaces the
    cluster's placement group), ``session_options`` further
    :class:`remotorch.Session` arguments (``tls_ca``, ``queue``, ``blocking``…).

    ``token``: the workers' shared secret; by default a fresh random one
    (``secrets.token_hex(32)``). It is never logged; it travels to the
    actors as a constructor argument through Ray's control plane (which must
    stay private to the cluster: see docs/security.md). ``host``: the
    address workers bind to; by default the node's address as Ray reports it
    (127.0.0.1 on a loopback-only cluster).

    Worker i is named ``ray-i`` (``remotorch.compile(fn, session=cluster.session,
    worker="ray-1")``).
    """

    def __init__(self, num_workers: int = 1, num_gpus_per_worker: float = 0, address: str | None = None, *,
                 num_cpus_per_worker: float = 1, engines: Sequence[str] | None = None, device: str | None = None,
                 token: str | None = None, host: str | None = None, max_restarts: int = 3,
                 start_timeout: float = 180.0, placement_strategy: str = "PACK",
                 placement_timeout: float = 30.0, wait_for_resources: bool = False,
                 serve_args: Sequence[str] = (), actor_options: Mapping | None = None,
                 session_options: Mapping | None = None, ray_init_kwargs: Mapping | None = None) -> None:
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
        if not num_gpus_per_worker >= 0 or not num_cpus_per_worker >= 0:
            raise ValueError("num_gpus_per_worker and num_cpus_per_worker must be >= 0")
        if token is not None and not token:
            raise ValueError("token must be a non-empty string (or None for a random one)")
        if not isinstance(max_restarts, int) or max_restarts < -1:
            raise ValueError(f"max_restarts must be an int >= -1 (-1: unlimited), got {max_restarts!r}")
        if placement_strategy not in _STRATEGIES:
            raise ValueError(f"placement_strategy must be one of {', '.join(_STRATEGIES)}, got {placement_strategy!r}")
        self.num_workers = num_workers
        self.num_gpus_per_worker = num_gpus_per_worker
        self.num_cpus_per_worker = num_cpus_per_worker
        self.address = address
        self.max_restarts = max_restarts
        self.start_timeout = start_timeout
        self.placement_strategy = placement_strategy
        self.placement_timeout = placement_timeout
        self.wait_for_resources = wait_for_resources
        self._token = token or secrets.token_hex(32)
        self._worker_kwargs = dict(
            host=host, device=device or ("cuda" if num_gpus_per_worker > 0 else "cpu"),
            threads=num_cpus_per_worker,
            serve_args=[*(["--engines", ",".join(engines)] if engines else []), *serve_args])
        self._actor_options = dict(actor_options or {})
        self._session_options = dict(session_options or {})
        self._ray_init_kwargs = dict(ray_init_kwargs or {})
        self._lock = threading.RLock()
        self._owns_ray = False
        self._remote_class = None
        self._group = None  # the placement group: one bundle per worker
        self._actors: list = []
        self._infos: list[dict] = []
        self._watches: list = []
        self._session: Session | None = None
        self._started = False

    # ------------------------------------------------------------------ lifetime
    def __enter__(self) -> RayCluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> RayCluster:
        """Start Ray (if needed), reserve the workers' resources, start them; returns when every worker serves.

        ``PlacementError`` if the workers do not fit (at once, or after
        ``placement_timeout``); ``WorkerUnavailableError`` (with the
        worker's own words) if one does not start within ``start_timeout``.
        Either way nothing is left running or reserved.
        """
        with self._lock:
            if self._started:
                return self
            ray = _ray()
            self._init_ray(ray)
            try:
                self._group = self._reserve(ray)
                self._remote_class = ray.remote(WorkerActor)
                self._actors = [self._spawn(i) for i in range(self.num_workers)]
                self._infos = self._read_infos(range(self.num_workers), self.start_timeout)
            except BaseException:
                self._teardown()
                raise
            self._watches = [a.watch.remote() for a in self._actors]
            self._started = True
            log.info("remotorch on Ray: %d workers at %s", self.num_workers, ", ".join(self.urls))
            return self

    def close(self) -> None:
        """Close the session, end every worker and its actor, release the placement group, shut Ray
        down if this cluster started it."""
        with self._lock:
            self._started = False
            self._teardown()

    def _init_ray(self, ray) -> None:
        if ray.is_initialized():
            self._owns_ray = False
            return
        kwargs = dict(self._ray_init_kwargs)
        if self.address is None:  # a new local cluster: each dashboard module costs ~150 MB
            kwargs.setdefault("include_dashboard", False)
        ray.init(address=self.address, **kwargs)
        self._owns_ray = True

    def _teardown(self) -> None:
        ray = _ray()
        if self._session is not None:
            self._session.close()
            self._session = None
        if self._actors:
            stops = [a.stop.remote() for a in self._actors]
            ray.wait(stops, num_returns=len(stops), timeout=30.0)  # each worker stops serving, then its actor ends
            for a in self._actors:
                _kill(ray, a)
        if self._group is not None:
            ray.util.remove_placement_group(self._group)
            self._group = None
        self._actors, self._infos, self._watches = [], [], []
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False

    # ------------------------------------------------------------------ placement and actors
    def _bundle(self) -> dict[str, float]:
        bundle = {"CPU": self.num_cpus_per_worker, "GPU": self.num_gpus_per_worker}
        return {k: v for k, v in bundle.items() if v > 0} or {"CPU": 0.01}  # Ray refuses an empty bundle

    def _reserve(self, ray):
        """The cluster's placement group, ready; ``PlacementError`` naming what does not fit."""
        if "scheduling_strategy" in self._actor_options:  # the user places the actors
            return None
        bundle = self._bundle()
        wanted = {k: v * self.num_workers for k, v in bundle.items()}
        if not self.wait_for_resources:
            total = ray.cluster_resources()
            short = {k: (v, total.get(k, 0.0)) for k, v in wanted.items() if v > total.get(k, 0.0) + 1e-9}
            if short:
                raise PlacementError(
                    f"RayCluster({self.num_workers}) needs {self.num_workers} x {_fmt(bundle)} = {_fmt(wanted)}, "
                    f"more than the Ray cluster has in total: "
                    + ", ".join(f"{k} {need:g} wanted, {have:g} in the cluster" for k, (need, have) in short.items())
                    + " (wait_for_resources=True waits for an autoscaler to add nodes)")
        group = ray.util.placement_group([dict(bundle) for _ in range(self.num_workers)],
                                         strategy=self.placement_strategy, name=f"remotorch-{secrets.token_hex(4)}")
        try:
            ray.get(group.ready(), timeout=self.placement_timeout)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(group)
            raise PlacementError(
                f"RayCluster({self.num_workers}): {self.num_workers} x {_fmt(bundle)} "
                f"({self.placement_strategy}) could not be placed within {self.placement_timeout:g}s; "
                f"free now: {_fmt(ray.available_resources(), keys=bundle)}") from None
        return group

    def _spawn(self, index: int):
        """Start worker ``index``'s actor on its bundle (returns at once; its worker starts in the background)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options = dict(num_cpus=self.num_cpus_per_worker, num_gpus=self.num_gpus_per_worker,
                       max_restarts=self.max_restarts, max_task_retries=0,
                       max_concurrency=4)  # info and stop must answer while watch waits
        if self._group is not None:
            if options["num_cpus"] == 0 and options["num_gpus"] == 0:
                options["num_cpus"] = 0.01  # the bundle's token CPU, so the actor is scheduled in it
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=self._group, placement_group_bundle_index=index)
        options.update(self._actor_options)
        return self._remote_class.options(**options).remote(index, self._token, name=f"ray-{index}",
                                                             **self._worker_kwargs)

    def _read_infos(self, indices: Sequence[int], timeout: float) -> list[dict]:
        """Each worker's report, waiting (up to ``timeout`` s) for actors that are (re)starting."""
        ray = _ray()
        deadline = time.monotonic() + timeout
        infos: dict[int, dict] = {}
        last: dict[int, str] = {}
        while True:
            todo = [i for i in indices if i not in infos]
            refs = {i: self._actors[i].info.remote() for i in todo}
            for i, ref in refs.items():
                try:
                    infos[i] = ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
                except ray.exceptions.GetTimeoutError:
                    last[i] = f"no answer within {timeout:.0f}s"
                except ray.exceptions.RayTaskError as exc:  # info raised: the worker could not start
                    cause = exc.cause
                    if isinstance(cause, RemoteError):
                        raise type(cause)(f"worker ray-{i}: {cause.message}") from None
                    raise WorkerUnavailableError(f"worker ray-{i}: {type(cause).__name__}: {cause}") from None
                except ray.exceptions.ActorDiedError as exc:  # restarts used up, or killed for good
                    hint = f" (cluster.restart({i}) starts a new one)" if self._started else ""
                    raise WorkerUnavailableError(f"worker ray-{i}'s actor is dead{hint}: "
                                                 f"{exc.error_msg.splitlines()[0]}") from None
                except ray.exceptions.RayActorError as exc:  # it died a moment ago and is restarting
                    last[i] = type(exc).__name__
            if len(infos) == len(indices):
                return [infos[i] for i in indices]
            if time.monotonic() >= deadline:
                i = next(i for i in indices if i not in infos)
                raise WorkerUnavailableError(f"worker ray-{i} did not come up within {timeout:.0f}s: {last.get(i)}")
            time.sleep(0.1)

    # ------------------------------------------------------------------ what users see
    @property
    def token(self) -> str:
        """The token every worker of the cluster accepts."""
        return self._token

    @property
    def urls(self) -> list[str]:
        """Each worker's URL, worker 0 first (as last read; see :meth:`refresh`)."""
        return [info["url"] for info in self._infos]

    @property
    def workers(self) -> list[dict]:
        """Each worker's last report: index, name, url, host, pid (of the worker, which is its actor's
        process), node_id, gpu_ids, incarnation (new on each start)."""
        return [dict(info) for info in self._infos]

    @property
    def session(self) -> Session:
        """A :class:`remotorch.Session` over every worker (made on first use, closed on exit).

        If a worker died since the session was made (its actor's watch came
        back), this first waits for Ray to restart it and gives a new session
        over the new URLs (the old one is closed; what it held on the
        workers is gone). Hold the cluster across failures, not the session.
        """
        with self._lock:
            self._check_started()
            if self._watches and self._changed():
                self.refresh()
            if self._session is None:
                self._session = Session(self.urls, token=self._token, **self._session_options)
            return self._session

    def refresh(self, timeout: float | None = None) -> bool:
        """Re-read every worker's URL, waiting for actors Ray is restarting; True if any worker changed.

        When one changed, the current session is closed and the next use of
        :attr:`session` makes one over the new set. ``WorkerUnavailableError``
        if a worker does not come back within ``timeout`` (default:
        ``start_timeout``) or its actor is dead for good (restarts used up).
        """
        with self._lock:
            self._check_started()
            infos = self._read_infos(range(self.num_workers), timeout or self.start_timeout)
            changed = [i for i, (old, new) in enumerate(zip(self._infos, infos))
                       if old["incarnation"] != new["incarnation"]]
            log.debug("refresh: incarnations %s -> %s", [x["incarnation"] for x in self._infos],
                      [x["incarnation"] for x in infos])
            self._infos = infos
            ray = _ray()
            ready, _ = ray.wait(self._watches, num_returns=len(self._watches), timeout=0)
            for i, ref in enumerate(self._watches):  # a new watch where the worker is new or the old one ended
                if i in changed or ref in ready:
                    self._watches[i] = self._actors[i].watch.remote()
            if changed:
                log.info("remotorch on Ray: workers %s restarted, now at %s", changed, ", ".join(self.urls))
                self._drop_session()
            return bool(changed)

    def restart(self, index: int, timeout: float | None = None) -> dict:
        """Replace worker ``index``: kill its actor (and so its worker) and start a fresh one; its new report.

        The fresh actor has its full ``max_restarts`` again. The session is
        closed; the next use of :attr:`session` makes one over the new set.
        """
        with self._lock:
            self._check_started()
            if not 0 <= index < self.num_workers:
                raise IndexError(f"worker index {index} out of range (0..{self.num_workers - 1})")
            ray = _ray()
            self._drop_session()
            _kill(ray, self._actors[index])
            self._actors[index] = self._spawn(index)
            self._infos[index] = self._read_infos([index], timeout or self.start_timeout)[0]
            self._watches[index] = self._actors[index].watch.remote()
            return dict(self._infos[index])

    def health(self, timeout: float = 5.0) -> list[dict]:
        """Each worker as a client sees it now: its actor's report and whether it answers remotorch's
        health request (``healthy``, ``error``), asked over a short session of its own."""
        self._check_started()
        ray = _ray()
        out = []
        for i, a in enumerate(self._actors):
            entry = dict(index=i, name=f"ray-{i}", healthy=False, error=None)
            try:
                entry.update(ray.get(a.info.remote(), timeout=timeout))
            except ray.exceptions.GetTimeoutError:
                entry.update(actor="unanswered", error=f"its actor did not answer within {timeout:g}s")
            except ray.exceptions.RayError as exc:
                entry.update(actor="dead", error=f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
            else:
                entry["actor"] = "alive"
                entry.update(_probe(entry["url"], self._token, timeout))
            out.append(entry)
        return out

    # ------------------------------------------------------------------ helpers
    def _changed(self) -> bool:
        ray = _ray()
        ready, _ = ray.wait(self._watches, num_returns=len(self._watches), timeout=0)
        return bool(ready)

    def _drop_session(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None

    def _check_started(self) -> None:
        if not self._started:
            raise RuntimeError("the RayCluster is not started (use it as a context manager, or call start())")

    def __repr__(self) -> str:
        state = ", ".join(self.urls) if self._started else "not started"
        return f"RayCluster({self.num_workers} workers: {state})"


_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def _fmt(resources: Mapping[str, float], keys: Mapping | None = None) -> str:
    return "{" + ", ".join(f"{k}: {resources.get(k, 0.0):g}" for k in (keys or resources)) + "}"


def _kill(ray, handle) -> None:
    try:
        ray.kill(handle, no_restart=True)
    except Exception as exc:  # already gone
        log.debug("killing a worker actor: %s", exc)


def _probe(url: str, token: str, timeout: float) -> dict:
    """Ask one worker for its health over a short-lived session of its own."""
    try:
        with Session(url, token=token, connect_timeout=timeout, timeout=timeout, retry_after=0.0) as s:
            info = s.health()
    except RemoteError as exc:
        return dict(healthy=False, error=f"{type(exc).__name__}: {exc}")
    return dict(healthy=True, device=info.get("device"), engines=info.get("engines"))

"""The Ray actor that *is* one remotorch worker: it serves in its own process, so Ray supervises it.

:class:`WorkerActor` builds the worker exactly as ``remotorch serve`` does
(:func:`remotorch.cli.make_server` on the same arguments) and serves it on a
thread of the actor process. There is no child process, so there is nothing
for remotorch to supervise beside Ray:

* the worker dies with its process (SIGKILL, out of memory, its node), which
  is the actor's process: Ray sees the death and restarts the actor
  (``max_restarts``), whose ``__init__`` starts a fresh worker on a new port;
* a worker that cannot start does not fail ``__init__`` (Ray would keep only
  the text of that error): the actor records it, and :meth:`WorkerActor.info`
  raises it, so the driver reads a typed :class:`~remotorch.errors.WorkerUnavailableError`
  from ``RayTaskError.cause``;
* if the serving thread ever ends without being asked to (a bug), the
  process exits at once, which Ray treats as any other death.

The token arrives as a constructor argument through Ray's control plane
(private to the cluster: docs/security.md) and is handed to the server
directly; it is never logged, put on a command line or in an environment.
"""

from __future__ import annotations

import math
import os
import sys
import threading


class WorkerActor:
    """One remotorch worker serving inside a Ray actor (use it through ``RayCluster``, which sets its resources)."""

    def __init__(self, index: int, token: str | None, *, name: str, host: str | None, device: str,
                 threads: float, serve_args: list[str]) -> None:
        import ray

        self.index = index
        self.name = name
        self.incarnation = os.urandom(8).hex()  # differs on each start, even if a port is reused
        self.host = host or ray.util.get_node_ip_address()
        self._stopped = threading.Event()
        self._server = None
        self._error: str | None = None
        argv = ["--host", self.host, "--port", "0", "--name", name, "--device", device,
                "--threads", str(max(1, math.ceil(threads))),
                "--group-host", self.host,  # process groups between workers: on the node's address (Ray's network)
                *serve_args]
        from ..cli import ServeError, make_server, serve_args as parse

        try:
            self._server = make_server(parse(argv), token=token)
        except Exception as exc:  # recorded for info(); Ray would keep only the text of an __init__ error
            what = str(exc) if isinstance(exc, ServeError) else f"{type(exc).__name__}: {exc}"
            self._error = f"remotorch serve cannot start on {self.host}: {what}"
            return
        self.url = self._server.url
        threading.Thread(target=self._serve, daemon=True, name="remotorch-serve").start()

    def _serve(self) -> None:
        try:
            self._server.serve_forever()
        finally:
            if not self._stopped.is_set():  # the worker stopped on its own: end the process, Ray restarts it
                sys.stderr.write(f"remotorch worker {self.name} stopped serving; ending its actor\n")
                sys.stderr.flush()
                os._exit(1)

    # ------------------------------------------------------------------ queries
    def info(self) -> dict:
        """Where the worker serves and who runs it; ``WorkerUnavailableError`` if it could not start."""
        if self._server is None:
            from ..errors import WorkerUnavailableError

            raise WorkerUnavailableError(self._error or "the worker did not start")
        import ray

        context = ray.get_runtime_context()
        return dict(index=self.index, name=self.name, url=self.url, host=self.host,
                    incarnation=self.incarnation, pid=os.getpid(), node_id=context.get_node_id(),
                    gpu_ids=[str(g) for g in ray.get_gpu_ids()])

    def watch(self) -> str:
        """Return (with this start's incarnation) when the worker is stopped; fails when the actor dies.

        The cluster keeps one call waiting on each actor: Ray fails it the
        moment the actor's process dies, which is how the driver learns of a
        death without polling.
        """
        self._stopped.wait()
        return self.incarnation

    # ------------------------------------------------------------------ stop
    def stop(self) -> None:
        """Stop serving (the request in progress finishes first); the cluster then kills the actor."""
        self._stopped.set()
        if self._server is not None:
            self._server.shutdown()

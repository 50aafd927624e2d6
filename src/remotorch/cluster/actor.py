"""The Ray actor that holds one ``remotorch serve`` process: it starts it, reports its URL, ends with it.

This module imports only the standard library (and ``ray`` inside the
actor). :class:`~remotorch.cluster.ray.RayCluster` ships the class to Ray
*by value*, so an actor process never imports ``remotorch`` or ``torch``:
the actor stays a small Python process (no second torch import next to the
worker's, about 230 MB and 2-3 s saved per worker and per restart). The
worker itself is the ordinary command line, ``python -m remotorch serve``,
read through the same ready line as :func:`remotorch.client.embedded.spawn_worker`.

The actor and its worker live and die together:

* the worker runs with ``--exit-on-stdin-close`` and its stdin is a pipe
  only this actor holds, so when the actor process ends for any reason,
  SIGKILL included, the kernel closes the pipe and the worker shuts down
  (no orphan; ``prctl(PR_SET_PDEATHSIG)`` was not used because it fires when
  the *thread* that started the child ends, and a threaded actor runs its
  methods on a pool of threads);
* a watchdog thread ends the actor process (``os._exit``) when the worker
  exits without being asked to, so Ray restarts the actor (``max_restarts``)
  and with it a fresh worker, on a new port.

The token reaches the worker in its environment (``REMOTORCH_TOKEN``), not
on its command line, and is never logged. Ray's own credentials
(``RAY_AUTH_*``) are removed from the worker's environment.
"""

from __future__ import annotations

import collections
import math
import os
import socket
import subprocess
import sys
import threading
import time

# the first line ``remotorch serve`` prints (remotorch.client.embedded.READY_PREFIX; a test keeps them equal)
READY_PREFIX = "remotorch: serving on "
_STDERR_LINES = 40  # how much of a failed worker's stderr an error quotes
_PF_EXITING = 0x4  # Linux task flag: the process is exiting (field 9 of /proc/PID/stat)
_SIGKILL_BIT = 1 << 8  # signal 9 in the pending masks of /proc/PID/status


class WorkerActor:
    """One remotorch worker inside a Ray actor (use it through ``RayCluster``, which sets its resources)."""

    def __init__(self, index: int, token: str | None, *, name: str, host: str | None, device: str,
                 threads: float, serve_args: list[str], start_timeout: float) -> None:
        self.index = index
        self.name = name
        self.incarnation = os.urandom(8).hex()  # differs on each start, even if a port is reused
        self.host = host or _node_ip()
        self._stopping = False
        self._exited = threading.Event()  # set by the watchdog, the one thread that waits for the worker
        self._stderr: collections.deque[str] = collections.deque(maxlen=_STDERR_LINES)
        args = ["--host", self.host, "--port", "0", "--name", name, "--device", device,
                "--threads", str(max(1, math.ceil(threads))), "--exit-on-stdin-close", *serve_args]
        self._proc = subprocess.Popen([sys.executable, "-m", "remotorch", "serve", *args],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      env=_worker_env(token), text=True)
        self.url = self._wait_ready(start_timeout)
        threading.Thread(target=self._watchdog, daemon=True, name="remotorch-watchdog").start()

    # ------------------------------------------------------------------ start
    def _wait_ready(self, timeout: float) -> str:
        found: list[str] = []
        reader = threading.Thread(target=self._read_stdout, args=(found,), daemon=True)
        reader.start()
        threading.Thread(target=self._read_stderr, daemon=True).start()
        deadline = time.monotonic() + timeout
        while not found and reader.is_alive() and time.monotonic() < deadline:
            reader.join(0.05)
        if found:
            return found[0]
        timed_out = self._proc.poll() is None
        self._end(kill=True)
        time.sleep(0.1)  # let the stderr reader take the last lines
        said = "\n".join(self._stderr).strip() or "(nothing on stderr)"
        why = (f"exited with code {self._proc.returncode}" if not timed_out
               else f"did not serve within {timeout:.0f}s")
        raise RuntimeError(f"remotorch serve {why} on {self.host}; its last words:\n{said}")

    def _read_stdout(self, found: list[str]) -> None:
        for line in self._proc.stdout:  # type: ignore[union-attr]
            if line.startswith(READY_PREFIX):
                found.append(line[len(READY_PREFIX):].strip())
                break
        for _ in self._proc.stdout:  # type: ignore[union-attr]  # drained so the worker never blocks
            pass

    def _read_stderr(self) -> None:
        for line in self._proc.stderr:  # type: ignore[union-attr]
            self._stderr.append(line.rstrip())
            sys.stderr.write(line)  # into this actor's Ray log file

    def _watchdog(self) -> None:
        self._proc.wait()
        self._exited.set()
        if not self._stopping:
            sys.stderr.write(f"remotorch worker {self.name} exited (code {self._proc.returncode}); "
                             "ending its actor so that Ray restarts it\n")
            sys.stderr.flush()
            os._exit(1)

    # ------------------------------------------------------------------ queries
    def info(self) -> dict:
        """Where the worker serves and who runs it; raises if the worker has just died (this actor
        is then about to end, and Ray to restart it)."""
        alive = self.alive()
        if not alive and not self._stopping:
            raise RuntimeError(f"remotorch worker {self.name} exited")
        return dict(index=self.index, name=self.name, url=self.url, host=self.host,
                    incarnation=self.incarnation, pid=self._proc.pid, actor_pid=os.getpid(),
                    alive=alive, node_id=_node_id(), gpu_ids=_gpu_ids())

    def alive(self) -> bool:
        """The worker runs and still listens.

        Its listening socket is the sure sign: a process being killed closes
        its sockets (and its clients see that) before its state says it
        exited, and ``Popen.poll()`` answers None while another thread (the
        watchdog) waits on the process.
        """
        return not self._exited.is_set() and _running(self._proc.pid) and _listening(self.url)

    def watch(self) -> str:
        """Return (with this start's incarnation) when the worker exits; the cluster keeps one waiting."""
        self._exited.wait()
        return self.incarnation

    # ------------------------------------------------------------------ stop
    def stop(self, timeout: float = 10.0) -> int | None:
        """End the worker (stdin closed, SIGTERM, then SIGKILL after ``timeout``); its exit code."""
        self._stopping = True
        self._end(timeout=timeout)
        return self._proc.returncode

    def _end(self, timeout: float = 10.0, kill: bool = False) -> None:
        proc = self._proc
        if proc.poll() is None:
            try:
                proc.stdin.close()  # type: ignore[union-attr]
            except OSError:
                pass
            proc.kill() if kill else proc.terminate()
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _worker_env(token: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH_", "REMOTORCH_"))}
    env["PYTHONUNBUFFERED"] = "1"
    if token:
        env["REMOTORCH_TOKEN"] = token
    return env


def _running(pid: int) -> bool:
    """The process exists and is not on its way out: not a zombie, not exiting, no SIGKILL pending.

    A killed process can take a while to die (freeing its memory comes
    before closing its sockets), and meanwhile the kernel still completes
    connections to its listening socket.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/status") as f:
            pending = [int(line.split()[1], 16) for line in f if line.startswith(("SigPnd:", "ShdPnd:"))]
    except FileNotFoundError:
        return False
    except (OSError, IndexError, ValueError):  # no /proc (not Linux): the watchdog's word alone
        return True
    exiting = int(fields[6]) & _PF_EXITING
    return fields[0] not in ("Z", "X") and not exiting and not any(p & _SIGKILL_BIT for p in pending)


def _listening(url: str) -> bool:
    """Something accepts TCP connections at the worker's ``tcp://`` or ``tls://`` URL (closed at once)."""
    host, _, port = url.split("://", 1)[1].rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5.0).close()
    except OSError:
        return False
    return True


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def _gpu_ids() -> list:
    import ray

    return [str(g) for g in ray.get_gpu_ids()]

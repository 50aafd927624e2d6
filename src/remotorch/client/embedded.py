"""Worker processes on this host: the embedded default worker, and :func:`spawn_worker` for tools.

The embedded worker is a real ``remotorch serve`` subprocess with a random
token, started when a session has no address and stopped when the session
closes or this process exits. The child also exits by itself when its stdin
closes, so it never outlives a crashed parent. It listens on a Unix socket
in a private temporary directory (mode 0700), which costs about half what
loopback TCP does per round trip; where Unix sockets are unavailable, or
``REMOTORCH_EMBEDDED_TRANSPORT=tcp`` says so, it listens on 127.0.0.1 at a
free port instead.

:func:`spawn_worker` is the one place that starts ``remotorch serve`` and
reads its ready line; tests and benchmarks use it too.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import weakref
from collections.abc import Mapping, Sequence

from ..errors import WorkerUnavailableError

READY_PREFIX = "remotorch: serving on "


class WorkerProcess:
    """A ``remotorch serve`` child process and the URL it serves on."""

    def __init__(self, proc: subprocess.Popen, url: str) -> None:
        self.proc = proc
        self.url = url

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """Ask it to stop (stdin closed, SIGTERM), kill it if it does not; idempotent."""
        _end(self.proc, timeout)

    def kill(self) -> None:
        """Kill it at once (SIGKILL) and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def spawn_worker(args: Sequence[str] = (), *, env: Mapping[str, str] | None = None, stderr=None,
                 stdin: int = subprocess.DEVNULL, start_timeout: float = 120.0) -> WorkerProcess:
    """Start ``python -m remotorch serve ARGS`` and wait until it prints that it serves.

    Its stdout is drained for as long as it runs (so the child never blocks
    on a full pipe). ``WorkerUnavailableError`` if it does not start in
    ``start_timeout`` seconds (then it is killed).
    """
    cmd = [sys.executable, "-m", "remotorch", "serve", *args]
    proc = subprocess.Popen(cmd, stdin=stdin, stdout=subprocess.PIPE, stderr=stderr,
                            env=dict(env) if env is not None else None, text=True)
    found: list[str] = []

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            if line.startswith(READY_PREFIX):
                found.append(line[len(READY_PREFIX):].strip())
                break
        for _ in proc.stdout:  # type: ignore[union-attr]
            pass

    reader = threading.Thread(target=read, daemon=True, name="remotorch-worker-stdout")
    reader.start()
    deadline = start_timeout
    while not found and reader.is_alive() and deadline > 0:
        reader.join(0.05)
        deadline -= 0.05
    if not found:
        exited = proc.poll() is not None
        if not exited:
            proc.kill()
        proc.wait()
        if exited:  # it refused its arguments (e.g. --allow-ops): its stderr says why
            raise WorkerUnavailableError(f"remotorch serve exited with code {proc.returncode} before serving "
                                         f"(its standard error says why)")
        raise WorkerUnavailableError(f"remotorch serve did not start within {start_timeout:.0f}s "
                                     f"(exit code {proc.returncode})")
    return WorkerProcess(proc, found[0])


class EmbeddedWorker:
    """A worker process on this host, owned by this process."""

    def __init__(self, device: str = "auto", *, start_timeout: float = 120.0,
                 transport: str | None = None, spin_us: float | None = None, allow_ops: Sequence[str] = (),
                 imports: Sequence[str] = (), cache_dir: str | None = None,
                 roots: Sequence[tuple[str, str]] = ()) -> None:
        self.token = secrets.token_hex(16)
        transport = transport or "unix"
        if transport not in ("unix", "tcp"):
            raise ValueError(f"embedded worker transport must be 'unix' or 'tcp', not {transport!r}")
        self._dir = None
        listen = ["--host", "127.0.0.1", "--port", "0"]
        if transport == "unix" and hasattr(socket, "AF_UNIX"):
            self._dir = tempfile.mkdtemp(prefix="remotorch-")  # mode 0700: this user only
            path = os.path.join(self._dir, "worker.sock")
            if len(path.encode()) < 100:  # sun_path holds about 104-108 bytes
                listen = ["--unix", path]
        self.transport = "unix" if listen[0] == "--unix" else "tcp"
        args = [*listen, "--name", "local", "--device", device, "--exit-on-stdin-close",
                # the worker shares this machine's cores with the caller: take half, so
                # neither side's kernel threads spin on cores the other needs
                "--threads", str(max(1, (os.cpu_count() or 2) // 2))]
        if spin_us is not None:  # as the session polls for replies, the worker polls for requests
            args += ["--spin-us", f"{spin_us:g}"]
        if allow_ops:  # custom operators of these libraries (see remotorch serve --allow-ops)
            args += ["--allow-ops", ",".join(allow_ops)]
        if imports:
            args += ["--import", ",".join(imports)]
        for flag, spec in roots:  # ("--weights" or "--checkpoints", "NAME=DIR")
            args += [flag, spec]
        args += _cache_args(cache_dir)
        try:
            self._worker = spawn_worker(args, env=dict(os.environ, REMOTORCH_TOKEN=self.token,
                                                       PYTHONUNBUFFERED="1"),
                                        stdin=subprocess.PIPE, start_timeout=start_timeout)
        except WorkerUnavailableError as exc:
            if self._dir is not None:
                shutil.rmtree(self._dir, ignore_errors=True)
            raise WorkerUnavailableError(f"the embedded worker did not start: {exc}") from None
        self._finalizer = weakref.finalize(self, _stop, self._worker.proc, self._dir)
        self.url = self._worker.url

    @property
    def pid(self) -> int:
        return self._worker.pid

    @property
    def args(self) -> list[str]:
        """The command line the worker runs with."""
        return list(self._worker.proc.args)

    def alive(self) -> bool:
        return self._worker.alive()

    def stop(self) -> None:
        """Stop the worker process (idempotent)."""
        self._finalizer()


def _cache_args(cache_dir: str | None) -> list[str]:
    """The embedded worker's disk cache: ``cache_dir``, else ``REMOTORCH_CACHE_DIR`` (``off``: none),
    else the per-user default under the platform's cache directory."""
    from ..config import default_cache_dir, from_env

    env = from_env()
    if cache_dir is None and env.cache_off:
        return ["--no-cache"]
    return ["--cache-dir", str(cache_dir or env.cache_dir or default_cache_dir())]


def _stop(proc: subprocess.Popen, directory: str | None = None) -> None:
    try:
        _end(proc)
    finally:
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)


def _end(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    if proc.poll() is None:
        try:
            if proc.stdin is not None:
                proc.stdin.close()
        except OSError:
            pass
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

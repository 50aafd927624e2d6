"""The embedded default worker: a real ``remotorch serve`` subprocess on this host.

Started with a random token when a session has no address, stopped when the
session closes or this process exits. The child also exits by itself when
its stdin closes, so it never outlives a crashed parent.

It listens on a Unix socket in a private temporary directory (mode 0700),
which costs about half what loopback TCP does per round trip; where Unix
sockets are unavailable, or ``REMOTORCH_EMBEDDED_TRANSPORT=tcp`` says so, it
listens on 127.0.0.1 at a free port instead.
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

from ..errors import WorkerUnavailableError

READY_PREFIX = "remotorch: serving on "


class EmbeddedWorker:
    """A worker process on this host, owned by this process."""

    def __init__(self, device: str = "auto", *, start_timeout: float = 120.0,
                 transport: str | None = None, spin_us: float = 0.0) -> None:
        self.token = secrets.token_hex(16)
        transport = transport or os.environ.get("REMOTORCH_EMBEDDED_TRANSPORT") or "unix"
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
        env = dict(os.environ, REMOTORCH_TOKEN=self.token, PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "remotorch", "serve", *listen,
               "--name", "local", "--device", device, "--exit-on-stdin-close",
               # the worker shares this machine's cores with the caller: take half, so
               # neither side's kernel threads spin on cores the other needs
               "--threads", str(max(1, (os.cpu_count() or 2) // 2))]
        if spin_us:  # the session busy-polls for replies: the worker for requests, alike
            cmd += ["--spin-us", f"{spin_us:g}"]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=None, env=env, text=True)
        self._finalizer = weakref.finalize(self, _stop, self._proc, self._dir)
        self.url = self._wait_ready(start_timeout)

    def _wait_ready(self, timeout: float) -> str:
        found: list[str] = []

        def read() -> None:
            for line in self._proc.stdout:  # type: ignore[union-attr]
                if line.startswith(READY_PREFIX):
                    found.append(line[len(READY_PREFIX):].strip())
                    break
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout)
        if not found:
            self.stop()
            raise WorkerUnavailableError(f"the embedded worker did not start within {timeout:.0f}s")
        # keep draining stdout so the child never blocks on a full pipe
        threading.Thread(target=lambda: [None for _ in self._proc.stdout], daemon=True).start()
        return found[0]

    @property
    def pid(self) -> int:
        return self._proc.pid

    def alive(self) -> bool:
        return self._proc.poll() is None

    def stop(self) -> None:
        """Stop the worker process (idempotent)."""
        self._finalizer()


def _stop(proc: subprocess.Popen, directory: str | None = None) -> None:
    try:
        _end(proc)
    finally:
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            proc.stdin.close()  # type: ignore[union-attr]
        except OSError:
            pass
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

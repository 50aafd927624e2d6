"""The container side of a remotorch worker on a cloud platform: TLS certificate, worker process, tunnel.

:func:`serve_in_container` is what a Modal container runs
(:func:`remotorch.deploy.modal.make_app` registers it as the app's
function). It opens a raw TCP tunnel to the worker's port, makes a
self-signed certificate for the tunnel's public host name (its private key
never leaves the container), starts ``remotorch serve`` with that
certificate and the client's token, and hands the address and the
certificate back to the client, which then trusts exactly that certificate
(pinning). TLS runs end to end between the client and the worker: the
platform's relay forwards ciphertext only.

With ``cache_dir`` the worker keeps its disk cache there (``remotorch serve
--cache-dir``): on Modal that folder is a ``modal.Volume`` (``volume``), so
a second run of the same script starts warm, with the weights, graphs and
compiled artifacts of the first already on the worker's disk. Without it the
worker runs with ``--no-cache``: a container never fills an ephemeral cache
that dies with it.

Nothing here imports the platform's SDK except the default tunnel and the
default Volume commit, so the same path runs on this machine in tests with a
loopback "tunnel" and a plain folder standing in for the Volume.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

from ..client.embedded import WorkerProcess, spawn_worker

log = logging.getLogger(__name__)


class Reply(Protocol):
    """Where the container puts the worker's address for the client (a ``modal.Queue``, a ``queue.Queue``)."""

    def put(self, item: Any) -> None: ...


def self_signed(host: str, days: float = 2.0) -> tuple[bytes, bytes]:
    """A new key and a certificate for ``host`` signed by that key (PEM bytes: certificate, key).

    The certificate names ``host`` in its subjectAltName (an IP address or a
    DNS name), so a client that trusts only this certificate also checks it
    reached that host.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"remotorch worker {host}"[:64])])
    try:
        alt = x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        alt = x509.DNSName(host)
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder()
            .subject_name(subject).issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName([alt]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def start_tls_worker(public_host: str, port: int, token: str, folder: str | Path, *, bind: str = "0.0.0.0",
                     name: str = "modal", price_per_hour: float = 0.0, engines: Sequence[str] | None = None,
                     days: float = 2.0, cache_dir: str | None = None) -> tuple[WorkerProcess, str]:
    """Start ``remotorch serve`` with TLS for ``public_host`` on ``bind:port``; returns it and its certificate.

    The key and certificate are written into ``folder`` (mode 0600 for the
    key); the token reaches the worker through its environment, not its
    command line. ``cache_dir`` is the worker's disk cache (``--cache-dir``:
    verified uploads, graphs and engine artifacts kept across restarts);
    without it the worker runs with ``--no-cache``, whatever
    ``REMOTORCH_CACHE_DIR`` says.
    """
    cert_pem, key_pem = self_signed(public_host, days)
    folder = Path(folder)
    cert_path, key_path = folder / "worker.crt", folder / "worker.key"
    cert_path.write_bytes(cert_pem)
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key_pem)
    args = ["--host", bind, "--port", str(port), "--name", name, "--price-per-hour", str(price_per_hour),
            "--tls-cert", str(cert_path), "--tls-key", str(key_path)]
    if engines:
        args += ["--engines", ",".join(engines)]
    args += ["--cache-dir", str(cache_dir)] if cache_dir else ["--no-cache"]
    proc = spawn_worker(args, env=dict(os.environ, REMOTORCH_TOKEN=token))
    return proc, cert_pem.decode()


def _modal_forward(port: int) -> AbstractContextManager:
    import modal

    return modal.forward(port, unencrypted=True)  # raw TCP: TLS is the worker's own, end to end


def _volume_commit(volume: str) -> Callable[[], None]:
    """``commit()`` of the Modal Volume named ``volume`` (mounted in this container)."""
    import modal

    return modal.Volume.from_name(volume).commit


def _fingerprint(folder: str | Path) -> tuple[int, int, int]:
    """(files, bytes, newest mtime in ns) under ``folder``, its ``tmp/`` left out: changes when the cache does.

    Entries appear by rename and reads bump their modification time, so a
    new, deleted or used entry changes it; half-written files in ``tmp/`` do not.
    """
    files = size = newest = 0
    for dirpath, dirnames, names in os.walk(folder):
        if dirpath == str(folder):
            dirnames[:] = [d for d in dirnames if d != "tmp"]
        for entry in names:
            try:
                st = os.lstat(os.path.join(dirpath, entry))
            except OSError:
                continue
            files, size, newest = files + 1, size + st.st_size, max(newest, st.st_mtime_ns)
    return files, size, newest


class _Committer:
    """Commits the cache's Volume when the folder changed: once it has been quiet for a check, at
    the latest ``6 * every`` seconds after the last commit, and at the end (:meth:`final`).

    A failed commit is logged, never raised: the worker serves on, and the next change retries.
    """

    def __init__(self, folder: str, commit: Callable[[], None], every: float) -> None:
        self.folder, self.commit, self.every = folder, commit, every
        self.committed = self.seen = _fingerprint(folder)
        self.last = self.next = time.monotonic()
        self.next += every

    def tick(self) -> None:
        now = time.monotonic()
        if now < self.next:
            return
        self.next = now + self.every
        current = _fingerprint(self.folder)
        quiet, self.seen = current == self.seen, current
        if current != self.committed and (quiet or now - self.last >= 6 * self.every):
            self._commit(current)

    def final(self) -> None:
        current = _fingerprint(self.folder)
        if current != self.committed:
            self._commit(current)

    def _commit(self, current: tuple[int, int, int]) -> None:
        try:
            self.commit()
        except Exception as exc:  # noqa: BLE001 - a Volume that cannot commit must not stop the worker
            log.warning("committing the cache's Volume failed (%s); retrying at the next change", exc)
            return
        self.committed, self.last = current, time.monotonic()
        log.info("committed the cache's Volume (%d files, %d bytes)", current[0], current[1])


def serve_in_container(token: str, reply: Reply, *, port: int = 7878, name: str = "modal",
                       price_per_hour: float = 0.0, engines: list[str] | None = None,
                       cache_dir: str | None = None, volume: str | None = None,
                       bind: str = "0.0.0.0", tunnel: Callable[[int], AbstractContextManager] | None = None,
                       stop: threading.Event | None = None, commit: Callable[[], None] | None = None,
                       commit_every: float = 10.0) -> int:
    """Run a TLS worker behind a tunnel until it exits (or ``stop`` is set); returns its exit code.

    Puts ``{"url": "tls://HOST:PORT", "cert": PEM, "name": name}`` into
    ``reply`` once the worker serves. ``tunnel(port)`` opens the public
    tunnel (default: ``modal.forward(port, unencrypted=True)``; tests give a
    loopback one, whose ``tcp_socket`` is the local address, with ``bind``
    ``127.0.0.1``). The platform ends the container at its timeout.

    ``cache_dir`` is the worker's disk cache (else ``--no-cache``). On Modal
    it is the mount point of the Volume named ``volume``, so the next
    container with the same Volume starts warm: weights, graphs and compiled
    artifacts are already there, and a client re-proves what it would
    upload instead of sending it. ``commit()`` (default: the Volume's
    ``commit``) runs when the folder changed, checked every
    ``commit_every`` seconds, and once after the worker exits.

    Why commit here at all: Modal 1.6.4 mounts every Volume with
    ``allow_background_commits=True`` (``modal/volume.py``,
    ``_volume_to_mount_proto``) and its container runtime commits those
    mounts when the function's container exits normally, after an
    ``os.sync()`` (``modal/_runtime/user_code_imports.py``,
    ``Service.execution_context`` → ``TaskLifecycleManager.volume_commit``).
    Both see the mount's file system, so files the worker *process* wrote
    count like the function's own. But a container stopped at its timeout
    or terminated by ``FunctionCall.cancel(terminate_containers=True)``
    (what :func:`remotorch.deploy.modal.launch` does at the end of its
    block) may never reach that exit commit, so the cache commits itself as
    it changes, and once more after the worker stops. The cache renames
    whole entries into place, so a commit holds an entry whole or not at
    all (a half-written file can only be under its ``tmp/``).
    """
    import tempfile

    opener = tunnel or _modal_forward
    if commit is None and volume and cache_dir:
        commit = _volume_commit(volume)
    with opener(port) as opened, tempfile.TemporaryDirectory(prefix="remotorch-tls-") as folder:
        host, public_port = opened.tcp_socket
        proc, cert = start_tls_worker(host, port, token, folder, bind=bind, name=name,
                                      price_per_hour=price_per_hour, engines=engines, cache_dir=cache_dir)
        committer = _Committer(cache_dir, commit, commit_every) if cache_dir and commit else None
        try:
            reply.put({"url": f"tls://{host}:{public_port}", "cert": cert, "name": name})
            log.info("worker %r serving on tls://%s:%s%s", name, host, public_port,
                     f", cache in {cache_dir}" if cache_dir else "")
            while proc.alive() and not (stop is not None and stop.is_set()):
                try:
                    proc.proc.wait(timeout=0.5)
                except subprocess.TimeoutExpired:
                    pass
                if committer is not None:
                    committer.tick()
        finally:
            proc.stop()
            if committer is not None:
                committer.final()
        return proc.proc.returncode or 0

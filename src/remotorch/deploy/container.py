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

Nothing here imports the platform's SDK except the default tunnel, so the
same path runs on this machine in tests with a loopback "tunnel".
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import threading
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
                     days: float = 2.0) -> tuple[WorkerProcess, str]:
    """Start ``remotorch serve`` with TLS for ``public_host`` on ``bind:port``; returns it and its certificate.

    The key and certificate are written into ``folder`` (mode 0600 for the
    key); the token reaches the worker through its environment, not its
    command line.
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
    proc = spawn_worker(args, env=dict(os.environ, REMOTORCH_TOKEN=token))
    return proc, cert_pem.decode()


def _modal_forward(port: int) -> AbstractContextManager:
    import modal

    return modal.forward(port, unencrypted=True)  # raw TCP: TLS is the worker's own, end to end


def serve_in_container(token: str, reply: Reply, *, port: int = 7878, name: str = "modal",
                       price_per_hour: float = 0.0, engines: list[str] | None = None,
                       bind: str = "0.0.0.0", tunnel: Callable[[int], AbstractContextManager] | None = None,
                       stop: threading.Event | None = None) -> int:
    """Run a TLS worker behind a tunnel until it exits (or ``stop`` is set); returns its exit code.

    Puts ``{"url": "tls://HOST:PORT", "cert": PEM, "name": name}`` into
    ``reply`` once the worker serves. ``tunnel(port)`` opens the public
    tunnel (default: ``modal.forward(port, unencrypted=True)``; tests give a
    loopback one, whose ``tcp_socket`` is the local address, with ``bind``
    ``127.0.0.1``). The platform ends the container at its timeout.
    """
    import tempfile

    opener = tunnel or _modal_forward
    with opener(port) as opened, tempfile.TemporaryDirectory(prefix="remotorch-tls-") as folder:
        host, public_port = opened.tcp_socket
        proc, cert = start_tls_worker(host, port, token, folder, bind=bind, name=name,
                                      price_per_hour=price_per_hour, engines=engines)
        try:
            reply.put({"url": f"tls://{host}:{public_port}", "cert": cert, "name": name})
            log.info("worker %r serving on tls://%s:%s", name, host, public_port)
            if stop is None:
                proc.proc.wait()
            else:
                while proc.alive() and not stop.wait(0.5):
                    pass
        finally:
            proc.stop()
        return proc.proc.returncode or 0

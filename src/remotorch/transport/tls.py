"""Optional TLS around the TCP transport: confidentiality and a certified worker.

TLS wraps the socket *under* the token handshake and the framing, which stay
exactly as they are: the token still decides who may talk to the worker, the
MAC still covers every message, and TLS adds encryption of every byte plus
the worker's certificate check (so a client never proves the token to an
impostor that holds a stolen address). It plays the role CurveZMQ plays in
the design document.

``ssl.SSLSocket`` has no ``sendmsg``; :class:`TlsSocket` supplies the few
socket methods the framing uses, sending scatter-gather lists buffer by
buffer (TLS copies into records anyway).
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Sequence


def server_context(certfile: str, keyfile: str | None = None) -> ssl.SSLContext:
    """A TLS 1.2+ server context for a worker's certificate chain and private key (PEM files)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(certfile, keyfile)
    return ctx


def client_context(cafile: str | None = None) -> ssl.SSLContext:
    """A verifying TLS 1.2+ client context: the system's CAs, or only ``cafile`` when given.

    Host names are checked against the certificate, so a certificate made for
    ``127.0.0.1`` must carry that address in its subjectAltName.
    """
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=cafile)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


class TlsSocket:
    """An ``ssl.SSLSocket`` with the ``sendmsg`` the framing's scatter-gather send expects.

    Everything else is passed through. The worker's selector loop watches the
    raw descriptor; a remotorch client never sends a request before the
    previous reply, so no request waits unseen in TLS's own buffer.
    """

    def __init__(self, sock: ssl.SSLSocket) -> None:
        self._sock = sock

    def sendmsg(self, buffers: Sequence, *_ignored) -> int:
        total = 0
        for buf in buffers:
            self._sock.sendall(buf)
            total += memoryview(buf).nbytes
        return total

    def shutdown(self, how: int) -> None:
        """Shut the descriptor down without a TLS close (safe while another thread reads)."""
        socket.socket.shutdown(self._sock, how)

    def __getattr__(self, name: str):
        return getattr(self._sock, name)


def wrap_server(ctx: ssl.SSLContext, sock: socket.socket) -> TlsSocket:
    """Run the TLS handshake as the worker (uses the socket's timeout); raises ``ssl.SSLError``/``OSError``."""
    return TlsSocket(ctx.wrap_socket(sock, server_side=True))


def wrap_client(ctx: ssl.SSLContext, sock: socket.socket, host: str) -> TlsSocket:
    """Run the TLS handshake as the client, checking the worker's certificate for ``host``."""
    return TlsSocket(ctx.wrap_socket(sock, server_hostname=host))

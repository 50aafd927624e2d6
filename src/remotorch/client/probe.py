"""A question to a worker outside any session, and how every reply is read: no torch here.

A :class:`~remotorch.client.session.Session` runs graphs, so it brings torch
with it. An operator's tools only ask a worker who it is (``Health``:
``remotorch health``) or how it is doing (``Stats``: ``remotorch top``), so
:class:`Probe` speaks the protocol over the transport directly: one
authenticated connection, one message at a time outside any session's
stream, each reply decoded by :func:`parse_reply`, the client's one reading
of a reply (errors raised as their ``remotorch.errors`` types), which
sessions use too.
"""

from __future__ import annotations

from .. import errors
from ..codec import messages as m
from ..transport import TcpTransport
from ..transport.tls import client_context


def parse_reply(header: bytes, url: str | None, expect: type | None = None) -> object:
    """Decode a reply's frame 0; an ``ErrorReply`` is raised as its ``RemoteError``; a reply that
    is not of type ``expect`` is a ``ProtocolError``."""
    try:
        reply = m.decode(header)
    except Exception as exc:
        raise errors.ProtocolError(f"unreadable reply from worker {url or 'local'}: {exc}") from None
    if type(reply) is m.ErrorReply:
        raise errors.from_reply(reply.kind, reply.message, reply.traceback, graphs=reply.graphs,
                                tensors=reply.tensors, handles=reply.handles, slots=reply.slots,
                                optims=reply.optims, bindings=reply.bindings)
    if expect is not None and type(reply) is not expect:
        raise errors.ProtocolError(f"worker {url or 'local'} answered with {type(reply).__name__}, "
                                   f"not {expect.__name__}")
    return reply


class Probe:
    """One connection to the worker at ``url`` for questions outside any session.

    It connects on the first question, and again after a lost connection;
    ``timeout`` bounds each answer, ``connect_timeout`` each connection.
    ``ValueError`` for an address that is not one.
    """

    def __init__(self, url: str, token: str | None = None, *, timeout: float | None = 5.0,
                 connect_timeout: float = 5.0, tls_ca: str | None = None) -> None:
        self.url = url
        self._transport = TcpTransport(url, token, protocol=m.PROTOCOL_VERSION, connect_timeout=connect_timeout,
                                       timeout=timeout, tls=client_context(tls_ca) if tls_ca else None)

    def ask(self, body, expect: type):
        """Send ``body`` and return its reply, of type ``expect`` (a worker's refusal raised)."""
        header, _ = self._transport.request(m.encode(body))
        return parse_reply(header, self.url, expect)

    def health(self) -> dict:
        """The worker's health reply as a dict: name, device, torch version, engines…"""
        reply = self.ask(m.Health(), m.HealthReply)
        return {f: getattr(reply, f) for f in reply.__struct_fields__}

    def close(self) -> None:
        self._transport.close()

    def __enter__(self) -> Probe:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

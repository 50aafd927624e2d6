"""The messages of values that stay on the worker (protocol.md §18): fetching them, and sending
them worker to worker under a one-time ticket.

They live beside :mod:`remotorch.codec.messages`, which takes them into its
``Request`` and ``Reply`` unions; import them from there (``m.Fetch``).
"""

from __future__ import annotations

from typing import Union

import msgspec

from .args import HandleArg, TensorMeta, ViewArg


class Fetch(msgspec.Struct, frozen=True, tag="fetch", omit_defaults=True):
    """Send back the tensors of handles (or of views of them), without dropping them."""

    args: list[Union[HandleArg, ViewArg]]


class FetchReply(msgspec.Struct, frozen=True, tag="fetch_reply", omit_defaults=True):
    """The fetched tensors, in frames, in the order asked."""

    values: list[TensorMeta]


class ExpectHandles(msgspec.Struct, frozen=True, tag="expect_handles", omit_defaults=True):
    """Prepare to receive tensors from another worker as these handles of this session.

    The worker answers a one-time ticket; a worker that presents it (``Deliver``)
    may store exactly these tensors, of exactly these layouts, and nothing else.
    """

    handles: list[int]
    metas: list[TensorMeta]  # dtype, shape, strides of each (``frame`` unused)
    ttl_s: float = 0.0  # how long the ticket may wait (0: the worker's default; capped by the worker)
    # a ticket the client chose (16 random bytes) and its secret (32): then the client need not wait
    # for the reply to hand it to the sending worker
    ticket_id: bytes = b""
    secret: bytes = b""


class TicketReply(msgspec.Struct, frozen=True, tag="ticket_reply", omit_defaults=True):
    """A one-time capability: ``ticket_id`` names it, ``secret`` authenticates its bearer."""

    ticket_id: bytes
    secret: bytes
    expires_s: float


class SendHandles(msgspec.Struct, frozen=True, tag="send_handles", omit_defaults=True):
    """Send these handles' tensors (or views) to the worker at ``url`` under its ticket; answered
    ``Ok`` once that worker stored them."""

    args: list[Union[HandleArg, ViewArg]]
    url: str
    ticket_id: bytes
    secret: bytes


class Deliver(msgspec.Struct, frozen=True, tag="deliver", omit_defaults=True):
    """Worker to worker, on a ticket connection: the tensors a ticket names, in frames. The first
    ``Deliver`` of a connection is under its hello's ticket (``ticket``, ``proof`` empty); each later
    one names its own ``ticket`` and proves its secret for this connection (§18.2)."""

    metas: list[TensorMeta]
    ticket: bytes = b""
    proof: bytes = b""

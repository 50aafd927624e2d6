"""What a handler of the service answers: the reply header and its buffer frames.

:data:`OK` is one object on purpose: the serving loop tells a reply that only
acknowledges its request by identity (``header is OK``) and may hold it back to
leave with the next one (:mod:`remotorch.transport.holding`).
"""

from __future__ import annotations

from ..codec import messages as m

Reply = tuple[bytes, list]
OK = m.encode(m.Ok())


def ok() -> Reply:
    return OK, []

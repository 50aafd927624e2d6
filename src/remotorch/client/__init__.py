"""The client: everything here runs in the user's process and talks to workers over a transport.

``connection`` (one worker: the one copy of request, upload and retry policy)
← ``pool`` (the workers of a session) ← ``session`` (the user-facing façade
and the runner captured graphs call); ``embedded`` starts worker processes
on this machine.
"""

from .connection import Connection
from .session import Session, default_session

__all__ = ["Connection", "Session", "default_session"]

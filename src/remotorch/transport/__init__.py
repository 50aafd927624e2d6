"""Moving framed messages between a session and a worker (knows nothing of graphs)."""

from .base import Transport
from .client import TcpTransport

__all__ = ["Transport", "TcpTransport"]

"""Exceptions raised by remotorch.

Every failure that involves the worker surfaces as a subclass of
:class:`RemoteError`, so a caller can catch one type::

    RemoteError
    ├── TransportError                 the bytes did not make it (socket, framing)
    │   ├── WorkerUnavailableError     no worker answers at the address (down, refused, timed out)
    │   │   └── PlacementError         a RayCluster's workers do not fit the Ray cluster's resources
    │   └── ProtocolError              a peer sent something that is not valid remotorch protocol
    ├── AuthenticationError            the token was wrong or missing
    ├── WorkerError                    the worker ran the request and it failed (carries its traceback)
    │   └── RemoteOutOfMemoryError     the worker ran out of device or host memory for this call
    ├── UnsupportedGraphError          the graph uses something the wire format or worker refuses
    ├── InvalidRequestError            a well-formed request that does not fit (wrong arguments for a graph)
    │   ├── ForeignParameterError      a parameter whose worker-side copy belongs to another session
    │   ├── PathRefusedError           a weights or checkpoint name the worker will not open (escape, root, file kind)
    │   └── CheckpointError            weight files that do not fit: missing, malformed, keys or shapes that differ
    ├── LimitExceededError             a request is over a size limit of the worker
    │   ├── QuotaExceededError         a session is over its memory quota (or the worker over its memory limit)
    │   └── RequestTimeoutError        a request ran longer than the worker's request timeout
    ├── MissingObjectsError            the worker lacks graphs/tensors the request names (session re-uploads)
    ├── GroupError                     a process group of workers failed: a member missing, dead or too slow
    └── UnknownBackendError            a profile names a WORKER/ENGINE pair the session's workers do not offer

Errors raised on the worker travel back as an ``ErrorReply`` whose ``kind``
names one of these classes; :func:`from_reply` rebuilds the exception.

Mistakes found on the client before anything is sent are ``ValueError``s:

    ValueError
    └── ScheduleError                  a pipeline schedule that cannot run (bad text, counts, placement, deadlock)
"""

from __future__ import annotations


class RemoteError(Exception):
    """Base class of all remotorch errors."""

    kind = "remote"

    def __init__(self, message: str = "", *, remote_traceback: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.remote_traceback = remote_traceback

    def __str__(self) -> str:
        if self.remote_traceback:
            return f"{self.message}\n--- worker traceback ---\n{self.remote_traceback}"
        return self.message


class TransportError(RemoteError):
    """The request or reply could not be carried (socket error, broken framing)."""

    kind = "transport"


class WorkerUnavailableError(TransportError):
    """No worker answered at the address: refused, down, or timed out."""

    kind = "unavailable"


class PlacementError(WorkerUnavailableError):
    """A ``RayCluster``'s workers do not fit: more than the Ray cluster has, or not placed in time.

    Raised on the client before any worker starts; the message names the
    resources asked for and what the cluster has.
    """

    kind = "placement"


class ProtocolError(TransportError):
    """A peer sent bytes that are not valid remotorch protocol (or another version)."""

    kind = "protocol"


class AuthenticationError(RemoteError):
    """The worker rejected the token (or the worker failed to prove it knows it)."""

    kind = "auth"


class WorkerError(RemoteError):
    """The worker accepted the request, ran it, and it raised; see ``remote_traceback``."""

    kind = "worker"


class RemoteOutOfMemoryError(WorkerError):
    """The worker ran out of memory for this call; it keeps serving."""

    kind = "oom"


class UnsupportedGraphError(RemoteError):
    """The graph uses an operation or value the wire format or the worker refuses."""

    kind = "unsupported"


class InvalidRequestError(RemoteError):
    """A well-formed request that does not fit what it names (argument count, dtype, rank)."""

    kind = "invalid"


class ForeignParameterError(InvalidRequestError):
    """A parameter trained in one session was given to another (an optimizer, a graph).

    After training, a parameter's value of record lives in its session's
    worker; another session would start from the stale local copy.
    """

    kind = "foreign"


class PathRefusedError(InvalidRequestError):
    """A name of weights or a checkpoint the worker refuses before opening anything.

    The worker reads only under the roots its operator named (``remotorch
    serve --weights NAME=DIR``, ``--checkpoints NAME=DIR``): an unknown root,
    no roots at all, an absolute name, ``..``, a NUL, a backslash, a percent
    escape, a path that resolves outside its root (a symlink out), a file that
    is not ``.safetensors`` or ``.json``, or a write into a read-only root.
    """

    kind = "refused"


class CheckpointError(InvalidRequestError):
    """Weight files that do not fit what was asked of them.

    Missing files (an incomplete hub-cache snapshot names those it lacks), a
    malformed safetensors header, or keys and shapes that differ from the
    model's (named, checked before any tensor data is read).
    """

    kind = "checkpoint"


class LimitExceededError(RemoteError):
    """A request exceeds one of the worker's size limits."""

    kind = "limit"


class QuotaExceededError(LimitExceededError):
    """A session exceeds its memory quota on the worker."""

    kind = "quota"


class RequestTimeoutError(LimitExceededError):
    """A request ran past the worker's request timeout and was stopped; the worker keeps serving."""

    kind = "timeout"


class MissingObjectsError(RemoteError):
    """The worker does not hold objects a request refers to.

    ``graphs`` and ``tensors`` (content ids) the session uploads again itself
    (e.g. after a worker restart), and ``bindings`` (argument bindings,
    ``Run.bound``) it makes again by sending the arguments; users see those
    only if doing so fails too. ``handles``, ``slots`` and ``optims`` name worker-side state
    (kept values, parameter slots, optimizers) that cannot be uploaded again.
    """

    kind = "missing"

    def __init__(self, message: str = "", *, graphs: list[str] | None = None,
                 tensors: list[str] | None = None, handles: list[int] | None = None,
                 slots: list[int] | None = None, optims: list[int] | None = None,
                 bindings: list[int] | None = None, remote_traceback: str | None = None) -> None:
        super().__init__(message, remote_traceback=remote_traceback)
        self.graphs = list(graphs or [])
        self.tensors = list(tensors or [])
        self.handles = list(handles or [])
        self.slots = list(slots or [])
        self.optims = list(optims or [])
        self.bindings = list(bindings or [])

    @property
    def recoverable(self) -> bool:
        """Whether uploading the graphs and tensors again is all it takes."""
        return not (self.handles or self.slots or self.optims)


class UnknownBackendError(RemoteError):
    """A backend (``WORKER/ENGINE``) that no worker of the session offers (raised by the client)."""

    kind = "backend"


class GroupError(RemoteError):
    """A process group of workers (data parallelism) could not form or a collective failed.

    A member did not join in time, died, or did not take part within the
    group's timeout; ``ranks`` names the members that did not join, where
    known. The workers keep serving; the group is unusable (form a new one).
    """

    kind = "group"

    def __init__(self, message: str = "", *, ranks: list[int] | None = None,
                 remote_traceback: str | None = None) -> None:
        super().__init__(message, remote_traceback=remote_traceback)
        self.ranks = list(ranks or [])


_BY_KIND: dict[str, type[RemoteError]] = {
    cls.kind: cls
    for cls in (RemoteError, TransportError, WorkerUnavailableError, ProtocolError,
                AuthenticationError, WorkerError, RemoteOutOfMemoryError,
                UnsupportedGraphError, InvalidRequestError, LimitExceededError, QuotaExceededError,
                RequestTimeoutError, ForeignParameterError, GroupError, PathRefusedError, CheckpointError)
}


def from_reply(kind: str, message: str, traceback: str | None, **missing) -> RemoteError:
    """Rebuild the exception a worker reported in an ``ErrorReply`` (``missing``: its lists of
    missing objects: graphs, tensors, handles, slots, optims, bindings)."""
    if kind == MissingObjectsError.kind:
        return MissingObjectsError(message, remote_traceback=traceback, **missing)
    return _BY_KIND.get(kind, WorkerError)(message, remote_traceback=traceback)


class ScheduleError(ValueError):
    """A pipeline schedule that cannot run: bad text, wrong counts, a stage on the wrong worker, a deadlock.

    Raised on the client, before any worker is asked to run anything. When
    one action is at fault, ``worker``, ``position`` (index in that worker's
    list) and ``action`` (its text, e.g. ``"1B0"``) name the first one.
    """

    def __init__(self, message: str, *, worker: int | None = None, position: int | None = None,
                 action: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.worker = worker
        self.position = position
        self.action = action


class RemoteFallbackWarning(RuntimeWarning):
    """A graph ran locally because the remote path failed (``fallback="local"``)."""

"""A worker's logs: human-readable by default, one JSON object per line with ``--log-format json``.

In JSON, every request served is also a record (logger ``remotorch.requests``,
level INFO) with its tenant, its session, its type, how long it took and how
it ended::

    {"ts": "2026-11-27T02:40:01.123Z", "level": "INFO", "logger": "remotorch.requests",
     "msg": "request", "tenant": "alice", "session": "s-3f9a1c20d4", "type": "run",
     "ms": 1.84, "outcome": "ok", "bytes_in": 412, "bytes_out": 161, "engine": "eager", "run_ms": 1.2}

Nothing secret is ever logged: no token, no session id (a capability: the
``session`` field is a short hash of it, enough to follow one session),
no tensor bytes, no graph documents.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging

REQUESTS = logging.getLogger("remotorch.requests")
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, and the record's extra fields."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
               .isoformat(timespec="milliseconds").replace("+00:00", "Z"),
               "level": record.levelname, "logger": record.name, "msg": record.getMessage()}
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure_json(verbose: bool = False) -> None:
    """Log as JSON, one object per line, with a record per request (``serve --log-format json``;
    the command line sets up the human-readable default itself)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.WARNING)
    REQUESTS.setLevel(logging.INFO)
    logging.getLogger("remotorch.serve").setLevel(logging.INFO)  # what serve says at start-up


def session_label(key: object) -> str:
    """How a log names a session: a short hash of a lease's id (never the id), or the connection."""
    session_id = getattr(key, "session_id", None)
    if session_id is not None:
        return "s-" + hashlib.sha256(session_id.encode()).hexdigest()[:10]
    return f"c{key}"


def log_request(tenant: str, session: object, kind: str, ms: float, outcome: str, nbytes_in: int,
                nbytes_out: int, run: tuple[str, float] | None) -> None:
    extra = {"tenant": tenant, "session": session_label(session), "type": kind, "ms": round(ms, 3),
             "outcome": outcome, "bytes_in": nbytes_in, "bytes_out": nbytes_out}
    if run is not None:
        extra.update(engine=run[0], run_ms=round(run[1], 3))
    REQUESTS.info("request", extra=extra)

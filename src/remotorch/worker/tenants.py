"""Who may use a worker: named tenants, each with its own token, quotas and custom-operator namespaces.

``remotorch serve --tokens FILE`` reads a TOML file, one table per tenant::

    [tenants.alice]
    token_sha256 = "…"            # hex SHA-256 of the token; the token itself is never stored
    memory_quota = "2G"           # optional: all of the tenant's sessions together
    max_sessions = 4              # optional
    requests_per_second = 200     # optional: a burst of one second's worth, then this rate
    allow_ops = ["transformers"]  # optional: within the worker's own --allow-ops
    operator = true               # optional: may watch the whole worker (remotorch top)

``--token`` is one unnamed tenant (named ``""``) without quotas of its own.

A connection names its tenant in the hello by a key id derived from the
token's hash (:func:`key_id`), and both ends prove the hash (never the token,
which the worker does not have) in the handshake
(:mod:`remotorch.transport.handshake`). A key id nobody holds is answered
as a wrong token is: the answer tells nothing.

:meth:`Tenants.reload` (SIGHUP) reads the file again and returns the key ids
that are gone: their connections' next request is refused with an
``AuthenticationError`` and their sessions end; every other tenant is
untouched.
"""

from __future__ import annotations

import hmac
import re
import threading
import time
from dataclasses import dataclass, field

from ..config import TENANT_NAME as NAME, parse_size
from ..transport.handshake import key_id, token_hash

_FIELDS = {"token_sha256", "memory_quota", "max_sessions", "requests_per_second", "allow_ops", "operator"}


class TokensFileError(ValueError):
    """The tokens file cannot be used as written (the message names the file and the tenant)."""


@dataclass
class Tenant:
    """One tenant: its name, the hash of its token, and its own limits (None: the worker's)."""

    name: str
    token_sha256: bytes
    memory_quota: int | None = None
    max_sessions: int | None = None
    requests_per_second: float | None = None
    allow_ops: frozenset[str] | None = None
    operator: bool = False  # may ask for the worker's activity (remotorch top): every tenant's figures
    _bucket: list = field(default_factory=list, repr=False, compare=False)  # [tokens, at]

    @property
    def key_id(self) -> bytes:
        return key_id(self.token_sha256)

    def admit(self, now: float | None = None) -> bool:
        """Take one request from the tenant's budget (always True without ``requests_per_second``)."""
        rate = self.requests_per_second
        if rate is None:
            return True
        now = time.monotonic() if now is None else now
        if not self._bucket:
            self._bucket[:] = [rate, now]
        tokens = min(rate, self._bucket[0] + (now - self._bucket[1]) * rate)
        if tokens < 1.0:
            self._bucket[:] = [tokens, now]
            return False
        self._bucket[:] = [tokens - 1.0, now]
        return True


def parse_tokens(text: str, source: str = "tokens file") -> dict[str, Tenant]:
    """The tenants a tokens file describes, by name (``TokensFileError`` naming what is wrong)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TokensFileError(f"{source}: not TOML: {exc}") from None
    unknown = set(doc) - {"tenants"}
    if unknown:
        raise TokensFileError(f"{source}: unknown top-level key(s) {sorted(unknown)} (only [tenants.NAME] tables)")
    tables = doc.get("tenants", {})
    if not isinstance(tables, dict):
        raise TokensFileError(f"{source}: 'tenants' must be tables: [tenants.NAME]")
    tenants: dict[str, Tenant] = {}
    seen: dict[bytes, str] = {}
    for name, t in tables.items():
        where = f"{source}: [tenants.{name}]"
        if not NAME.fullmatch(name):
            raise TokensFileError(f"{where}: a name is 1 to 64 characters of [A-Za-z0-9_.-]")
        if not isinstance(t, dict):
            raise TokensFileError(f"{where}: must be a table")
        extra = set(t) - _FIELDS
        if extra:
            raise TokensFileError(f"{where}: unknown key(s) {sorted(extra)} (known: {sorted(_FIELDS)})")
        digest = t.get("token_sha256")
        if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-fA-F]{64}", digest):
            raise TokensFileError(f"{where}: token_sha256 must be 64 hex digits (remotorch token new {name} "
                                  "prints a token and its table)")
        raw = bytes.fromhex(digest)
        if raw in seen:
            raise TokensFileError(f"{where}: the same token as [tenants.{seen[raw]}]")
        seen[raw] = name
        tenants[name] = Tenant(name, raw, memory_quota=_quota(t, where), max_sessions=_count(t, where),
                               requests_per_second=_rate(t, where), allow_ops=_ops(t, where),
                               operator=_flag(t, "operator", where))
    return tenants


def _quota(t: dict, where: str) -> int | None:
    value = t.get("memory_quota")
    if value is None:
        return None
    try:
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 \
            else parse_size(str(value)) if isinstance(value, str) else _bad()
    except ValueError as exc:
        raise TokensFileError(f"{where}: memory_quota: {exc}") from None


def _count(t: dict, where: str) -> int | None:
    value = t.get("max_sessions")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TokensFileError(f"{where}: max_sessions must be a whole number of at least 1")
    return value


def _rate(t: dict, where: str) -> float | None:
    value = t.get("requests_per_second")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise TokensFileError(f"{where}: requests_per_second must be a number above 0")
    return float(value)


def _ops(t: dict, where: str) -> frozenset[str] | None:
    value = t.get("allow_ops")
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise TokensFileError(f"{where}: allow_ops must be a list of namespace names")
    return frozenset(value)


def _flag(t: dict, key: str, where: str) -> bool:
    value = t.get(key, False)
    if not isinstance(value, bool):
        raise TokensFileError(f"{where}: {key} must be true or false")
    return value


def _bad():
    raise ValueError("a size such as 2G, or a number of bytes")


class Tenants:
    """The tenants a worker admits, by key id; replaced as a whole by :meth:`reload`.

    ``path``: a tokens file; ``token``: the unnamed tenant of ``--token``
    (both may be given). With neither, the one tenant is the empty token
    (a loopback worker without a token).
    """

    def __init__(self, path: str | None = None, token: str | None = None) -> None:
        self.path = path
        self._token = token
        self._lock = threading.Lock()
        self._by_key: dict[bytes, Tenant] = self._read()

    def _read(self) -> dict[bytes, Tenant]:
        tenants: dict[str, Tenant] = {}
        if self.path is not None:
            try:
                with open(self.path, encoding="utf-8") as f:
                    tenants = parse_tokens(f.read(), self.path)
            except OSError as exc:
                raise TokensFileError(f"cannot read the tokens file: {exc}") from None
        if self._token is not None or self.path is None:
            unnamed = Tenant("", token_hash(self._token or ""), operator=True)  # --token: the operator's
            if any(hmac.compare_digest(t.token_sha256, unnamed.token_sha256) for t in tenants.values()):
                raise TokensFileError("--token is also a tenant's token in the tokens file")
            tenants[""] = unnamed
        return {t.key_id: t for t in tenants.values()}

    @property
    def legacy_token(self) -> bytes | None:
        """The raw ``--token`` (or the empty one): what a hello without a key id is checked against."""
        if self._token is not None:
            return self._token.encode()
        return b"" if self.path is None else None

    def secret(self, kid: bytes) -> bytes | None:
        """The token hash a hello's key id names (None: no such tenant)."""
        tenant = self._by_key.get(kid)
        return None if tenant is None else tenant.token_sha256

    def get(self, kid: bytes | None) -> Tenant | None:
        """The tenant of a key id (None: revoked or never known); ``None`` asks for the unnamed one."""
        if kid is None:
            return self._by_key.get(key_id(token_hash(self._token or ""))) if self.legacy_token is not None else None
        return self._by_key.get(kid)

    def names(self) -> list[str]:
        return sorted(t.name for t in self._by_key.values())

    def all(self) -> list[Tenant]:
        """Every tenant admitted now."""
        return list(self._by_key.values())

    def reload(self) -> list[bytes]:
        """Read the file again; the key ids no longer admitted (their holders' sessions end).

        A tenant whose token and limits are unchanged keeps its object (and
        its request budget); a changed one is replaced. A file that cannot be
        read leaves everything as it was (``TokensFileError``).
        """
        fresh = self._read()
        with self._lock:
            old = self._by_key
            for kid, tenant in fresh.items():
                prev = old.get(kid)
                if prev is not None and prev == tenant:
                    fresh[kid] = prev
            self._by_key = fresh
        return [kid for kid in old if kid not in fresh]

"""Configuration read from the environment, in one place."""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EnvConfig:
    """What the environment says about where the worker is and how to reach it."""

    url: str | None
    token: str | None
    spin_us: float | None = None  # None: auto
    embedded_transport: str | None = None  # "unix" or "tcp" for the embedded worker (None: unix)
    allow_ops: str | None = None  # custom-operator namespaces the embedded worker allows ("a,b")
    worker_imports: str | None = None  # modules the embedded worker imports to register them ("m,n")
    tls_ca: str | None = None  # PEM file of the CA (or the one pinned certificate) tls:// workers must have
    progress: bool = True  # progress bars on a terminal (REMOTORCH_PROGRESS=0 turns them off)
    cache_dir: str | None = None  # the worker's disk cache folder (None: the embedded worker's default)
    cache_off: bool = False  # REMOTORCH_CACHE_DIR=off: no disk cache, the embedded worker's included
    launch_blocking: bool = False  # REMOTORCH_LAUNCH_BLOCKING=1: every request waits for its reply
    weights: str | None = None  # the embedded worker's weight roots ("NAME=DIR,NAME=DIR")
    checkpoints: str | None = None  # the embedded worker's checkpoint roots ("NAME=DIR")


def from_env() -> EnvConfig:
    """``REMOTORCH_URL``, ``REMOTORCH_TOKEN``, ``REMOTORCH_TLS_CA``, ``REMOTORCH_SPIN_US``,
    ``REMOTORCH_EMBEDDED_TRANSPORT``, ``REMOTORCH_PROGRESS`` (``0``, ``false``, ``no`` or ``off``:
    no progress bars), ``REMOTORCH_CACHE_DIR`` (a folder, or ``off``), ``REMOTORCH_ALLOW_OPS`` and
    ``REMOTORCH_WORKER_IMPORTS``, ``REMOTORCH_WEIGHTS`` and ``REMOTORCH_CHECKPOINTS``
    (``NAME=DIR,NAME=DIR``), ``REMOTORCH_LAUNCH_BLOCKING`` (``1``, ``true``, ``yes`` or ``on``:
    every request waits for its reply, for debugging, as ``CUDA_LAUNCH_BLOCKING`` does), empty
    values counting as unset.

    ``ALLOW_OPS``, ``WORKER_IMPORTS``, ``WEIGHTS`` and ``CHECKPOINTS`` are for the
    embedded worker only (its ``--allow-ops``, ``--import``, ``--weights`` and
    ``--checkpoints``); ``remotorch serve`` takes them only as flags, so a worker
    never trusts more than its command line says.

    A ``REMOTORCH_SPIN_US`` that is not a number >= 0 is a ``ValueError``
    naming the variable. ``REMOTORCH_TOKEN`` is also the default token of
    ``remotorch serve``.
    """
    spin_us = parse_spin_us(os.environ.get("REMOTORCH_SPIN_US"), "REMOTORCH_SPIN_US")
    cache = (os.environ.get("REMOTORCH_CACHE_DIR") or "").strip()
    cache_off = cache.lower() in ("off", "none", "0", "no", "false")
    return EnvConfig(url=os.environ.get("REMOTORCH_URL") or None,
                     token=os.environ.get("REMOTORCH_TOKEN") or None, spin_us=spin_us,
                     embedded_transport=os.environ.get("REMOTORCH_EMBEDDED_TRANSPORT") or None,
                     allow_ops=os.environ.get("REMOTORCH_ALLOW_OPS") or None,
                     worker_imports=os.environ.get("REMOTORCH_WORKER_IMPORTS") or None,
                     tls_ca=os.environ.get("REMOTORCH_TLS_CA") or None,
                     cache_dir=None if cache_off else cache or None, cache_off=cache_off,
                     progress=(os.environ.get("REMOTORCH_PROGRESS") or "1").strip().lower()
                     not in ("0", "false", "no", "off"),
                     launch_blocking=(os.environ.get("REMOTORCH_LAUNCH_BLOCKING") or "").strip().lower()
                     in ("1", "true", "yes", "on"),
                     weights=os.environ.get("REMOTORCH_WEIGHTS") or None,
                     checkpoints=os.environ.get("REMOTORCH_CHECKPOINTS") or None)


def parse_spin_us(value: str | float | None, what: str) -> float | None:
    """A spin setting in microseconds: a number >= 0, or ``auto`` (None); ValueError naming ``what``."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "auto")):
        return None
    try:
        us = float(value)
        if not us >= 0:
            raise ValueError
    except ValueError:
        raise ValueError(f"{what} must be 'auto' or a number of microseconds >= 0, got {value!r}") from None
    return us



def default_cache_dir() -> Path:
    """The embedded worker's disk cache: the platform's per-user cache directory + ``remotorch``
    (``$XDG_CACHE_HOME`` or ``~/.cache`` on Linux, ``~/Library/Caches`` on macOS, ``%LOCALAPPDATA%``
    on Windows)."""
    home = Path.home()
    if sys.platform == "win32":
        return Path(os.environ.get("LOCALAPPDATA") or home / "AppData" / "Local") / "remotorch" / "Cache"
    if sys.platform == "darwin":
        return home / "Library" / "Caches" / "remotorch"
    return Path(os.environ.get("XDG_CACHE_HOME") or home / ".cache") / "remotorch"


# A tenant's name in a worker's --tokens file (``[tenants.NAME]``) and in ``remotorch token new NAME``.
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """A byte count: an integer with an optional K, M, G or T suffix (powers of 1024); ValueError if not."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = text[-1:] if text[-1:] in _UNITS else ""
    try:
        value = float(text[:len(text) - len(unit)])
    except ValueError:
        raise ValueError(f"not a size: {text!r} (e.g. 512M, 8G)") from None
    if value < 0:
        raise ValueError("a size cannot be negative")
    return int(value * _UNITS[unit])

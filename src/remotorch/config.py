"""Configuration read from the environment, in one place."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvConfig:
    """What the environment says about where the worker is."""

    url: str | None
    token: str | None


def from_env() -> EnvConfig:
    """``REMOTORCH_URL`` and ``REMOTORCH_TOKEN``, empty values counting as unset."""
    return EnvConfig(url=os.environ.get("REMOTORCH_URL") or None,
                     token=os.environ.get("REMOTORCH_TOKEN") or None)

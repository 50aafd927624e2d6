"""The messages of the worker's disk cache (protocol.md §20): what a restarted worker still has.

They live beside :mod:`remotorch.codec.messages`, which takes them into its
``Request`` and ``Reply`` unions; import them from there (``m.Have``).
"""

from __future__ import annotations

import msgspec


class Challenge(msgspec.Struct, frozen=True, tag="challenge", omit_defaults=True):
    """Ask for this session's nonce, to prove possession with (answered ``ChallengeReply``)."""


class ChallengeReply(msgspec.Struct, frozen=True, tag="challenge_reply", omit_defaults=True):
    """``nonce``: this session's, for :func:`remotorch.codec.possession.proof`; empty when the worker
    keeps no disk cache (asking ``Have`` would then find only what the session uploaded)."""

    nonce: bytes = b""


class Have(msgspec.Struct, frozen=True, tag="have", omit_defaults=True):
    """Hold these graphs and tensors for this session if the worker has them, from memory or its
    disk cache: ``[id, total bytes, proof]`` each (answered ``HaveReply`` with the ids now held)."""

    graphs: list[tuple[str, int, bytes]] = []
    tensors: list[tuple[str, int, bytes]] = []


class HaveReply(msgspec.Struct, frozen=True, tag="have_reply", omit_defaults=True):
    """The ids of the ``Have`` that the session now holds; upload the others."""

    graphs: list[str] = []
    tensors: list[str] = []

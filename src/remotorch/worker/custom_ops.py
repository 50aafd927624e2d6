"""Custom operators a worker allows: which namespaces, and importing what registers them.

``remotorch serve --allow-ops transformers,mylib --import mypkg.ops`` makes the
worker, at start-up and before it listens, import

* each module given with ``--import`` (the operator names them; nothing a
  client sends is ever imported), and
* for each allowed namespace with an entry in :data:`WELL_KNOWN`, the module
  of the installed library that registers it (``transformers`` →
  ``transformers.integrations.moe``),

then checks that every allowed namespace has operators registered in the
process. Graph documents may then call operators of those namespaces, by
name, and only those already registered here (:mod:`remotorch.codec.ops`).
"""

from __future__ import annotations

import importlib
import logging
import re
from collections.abc import Iterable

from ..codec.ops import CORE_NAMESPACES, registered_namespaces

log = logging.getLogger(__name__)

# Namespace -> the module of the library that registers its operators on import.
WELL_KNOWN: dict[str, str] = {
    "transformers": "transformers.integrations.moe",  # grouped_mm_fallback (+ _backward): MoE experts
    "transformers_msa": "transformers.integrations.msa_attention",
    "quantized_decomposed": "torch.ao.quantization.fx._decomposed",
    "torchao": "torchao",
    "xformers": "xformers.ops",
    "flash_attn": "flash_attn",
    "bitsandbytes": "bitsandbytes",
}
_NAMESPACE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


class AllowOpsError(ValueError):
    """The worker cannot allow these namespaces (bad name, import failed, nothing registered)."""


def split_names(text: str | Iterable[str] | None) -> list[str]:
    """``"a,b"`` or ``["a", "b"]`` as a list of names (empty entries dropped, order kept, no repeats)."""
    if text is None:
        return []
    parts = text.split(",") if isinstance(text, str) else [p for t in text for p in str(t).split(",")]
    out: list[str] = []
    for p in (p.strip() for p in parts):
        if p and p not in out:
            out.append(p)
    return out


def load_allowed(namespaces: Iterable[str], imports: Iterable[str] = ()) -> frozenset[str]:
    """Import what registers ``namespaces`` (and every module in ``imports``); the namespaces.

    ``AllowOpsError`` when a name is not an identifier, names aten/prims
    (their operators are always resolved, under the denylist), a module does
    not import, or a namespace has no operator registered afterwards (the
    message says which ``--import`` would be needed).
    """
    allowed = split_names(namespaces)
    for ns in allowed:
        if not _NAMESPACE.match(ns):
            raise AllowOpsError(f"--allow-ops: {ns[:80]!r} is not an operator namespace")
        if ns in CORE_NAMESPACES:
            raise AllowOpsError(f"--allow-ops: {ns} operators are always available (under the worker's "
                                f"denylist); allow only library namespaces")
    modules = split_names(imports)
    for module in modules:
        if not _MODULE.match(module):
            raise AllowOpsError(f"--import: {module[:80]!r} is not a module name")
        _import(module, "--import")
    present = registered_namespaces()
    for ns in allowed:
        if ns not in present and ns in WELL_KNOWN:
            _import(WELL_KNOWN[ns], f"namespace {ns}")
            present = registered_namespaces()
        if ns not in present:
            hint = (f"is {WELL_KNOWN[ns].split('.')[0]} installed?" if ns in WELL_KNOWN
                    else "give --import MODULE naming the module that registers them")
            raise AllowOpsError(f"--allow-ops: no operators of namespace {ns!r} are registered in this "
                                f"worker ({hint})")
    if allowed:
        log.info("custom operators allowed from namespaces: %s", ", ".join(allowed))
    return frozenset(allowed)


def _import(module: str, why: str) -> None:
    try:
        importlib.import_module(module)
    except Exception as exc:  # a library that fails to import is the operator's to fix: say so
        raise AllowOpsError(f"{why}: cannot import {module}: {type(exc).__name__}: {exc}") from None

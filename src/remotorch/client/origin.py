"""Where in the user's program a request was issued: the Python line outside remotorch and torch.

A request sent without waiting fails later than the line that sent it; its
error names that line, as Monarch's controller keeps each message's issuing
stack. Taking it costs a walk up the stack keeping (code, line) pairs, no
formatting and no frame objects (which would keep every local alive); the
text is made only when an error is raised.

Two frames are kept: the innermost one outside remotorch and torch (often a
library's, such as a Hugging Face model's ``forward``), and the innermost one
of the user's own code (outside the interpreter's installation and its
site-packages), which is the line an error names first.
"""

from __future__ import annotations

import os
import site
import sys
import sysconfig

import torch

_REMOTORCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_SKIP = (_REMOTORCH, _TORCH)


def _installed() -> tuple[str, ...]:
    """Folders of installed code: the standard library and every site-packages."""
    paths = {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    try:
        paths.update(site.getsitepackages())
    except AttributeError:  # some embedded interpreters
        pass
    paths.add(site.getusersitepackages() if hasattr(site, "getusersitepackages") else None)
    return tuple(os.path.abspath(p) + os.sep for p in paths if p)


_LIBRARIES = _installed()

Origin = tuple[tuple[object, int], ...]


_SKIPPED, _LIBRARY, _USER = 0, 1, 2
_kinds: dict[object, int] = {}  # code object -> which of the three its file is (a walk costs lookups only)


def _kind(code) -> int:
    name = code.co_filename
    kind = _SKIPPED if name.startswith(_SKIP) or name.startswith("<") else (
        _LIBRARY if name.startswith(_LIBRARIES) else _USER)
    if len(_kinds) < 100_000:  # (generated code could make them without end)
        _kinds[code] = kind
    return kind


def here() -> Origin:
    """(the user's innermost frame, and the innermost frame outside remotorch and torch if it is another)."""
    f = sys._getframe(1)
    inner = None
    kinds = _kinds
    while f is not None:
        code = f.f_code
        kind = kinds.get(code)
        if kind is None:
            kind = _kind(code)
        if kind:
            if kind == _USER:
                return ((code, f.f_lineno),) if inner is None else ((code, f.f_lineno), inner)
            if inner is None:
                inner = (code, f.f_lineno)
        f = f.f_back
    return () if inner is None else (inner,)


def describe(origin: Origin) -> str:
    """``file:line in function`` of the user's frame (and, in parentheses, the library frame inside it)."""
    if not origin:
        return "(issued inside remotorch)"
    code, line = origin[0]
    text = f"{code.co_filename}:{line} in {code.co_name}"
    if len(origin) > 1:
        inner, inner_line = origin[1]
        text += f" (in {inner.co_filename}:{inner_line} in {inner.co_name})"
    return text


def first_line(origin: Origin) -> str:
    """``file:line`` of the user's frame (for trace events and short lists)."""
    if not origin:
        return ""
    code, line = origin[0]
    return f"{code.co_filename}:{line}"

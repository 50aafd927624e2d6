"""Where in the user's program a request was issued: the Python line outside remotorch and torch.

A request sent without waiting fails later than the line that sent it; its
error names that line, as Monarch's controller keeps each message's issuing
stack. Taking it costs a walk up the stack keeping (code, instruction) pairs, no
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

Origin = tuple[tuple[object, int], ...]  # (code, the frame's f_lasti) pairs: see line_of


_SKIPPED, _LIBRARY, _USER = 0, 1, 2
# file name -> which of the three it is (a walk costs lookups only). By file name, not by code object:
# a str caches its hash, where hashing a code object hashes its whole bytecode and constants each time
_kinds: dict[str, int] = {}


def _kind(name: str) -> int:
    kind = _SKIPPED if name.startswith(_SKIP) or name.startswith("<") else (
        _LIBRARY if name.startswith(_LIBRARIES) else _USER)
    if len(_kinds) < 100_000:  # (generated code could make them without end)
        _kinds[name] = kind
    return kind


def here(depth: int = 1) -> Origin:
    """(the user's innermost frame, and the innermost frame outside remotorch and torch if it is another).

    ``depth``: the first frame that may be outside remotorch (1: the caller's). Frames below it are
    not looked at, so Python need not make objects of them (each costs microseconds: a frame object
    is made only when asked for, and then each return of its function copies it).
    """
    f = sys._getframe(depth)
    inner = None
    kinds = _kinds
    while f is not None:
        code = f.f_code
        kind = kinds.get(code.co_filename)
        if kind is None:
            kind = _kind(code.co_filename)
        if kind:
            if kind == _USER:
                return ((code, f.f_lasti),) if inner is None else ((code, f.f_lasti), inner)
            if inner is None:
                inner = (code, f.f_lasti)
        f = f.f_back
    return () if inner is None else (inner,)


def line_of(code, lasti: int) -> int | None:
    """The line of the instruction at byte offset ``lasti`` of ``code`` (a frame's ``f_lasti``).

    Frames are kept as (code, instruction) and turned into lines only here,
    when an error or a trace needs the text: ``f_lineno`` decodes the code's
    line table from its start, which costs microseconds in a long function.
    """
    for start, end, line in code.co_lines():
        if start <= lasti < end:
            return line
    return None


def describe(origin: Origin) -> str:
    """``file:line in function`` of the user's frame (and, in parentheses, the library frame inside it)."""
    if not origin:
        return "(issued inside remotorch)"
    code, lasti = origin[0]
    text = f"{code.co_filename}:{line_of(code, lasti)} in {code.co_name}"
    if len(origin) > 1:
        inner, inner_lasti = origin[1]
        text += f" (in {inner.co_filename}:{line_of(inner, inner_lasti)} in {inner.co_name})"
    return text


def first_line(origin: Origin) -> str:
    """``file:line`` of the user's frame (for trace events and short lists)."""
    if not origin:
        return ""
    code, lasti = origin[0]
    return f"{code.co_filename}:{line_of(code, lasti)}"

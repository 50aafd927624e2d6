"""Where in the user's program a request was issued: the Python lines outside remotorch and torch.

A request sent without waiting fails later than the line that sent it; its
error names that line, as Monarch's controller keeps each message's issuing
stack. Taking it costs a walk up the stack keeping (code, line) pairs, no
formatting and no frame objects (which would keep every local alive); the
text is made only when an error is raised.
"""

from __future__ import annotations

import os
import sys

import torch

_REMOTORCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_SKIP = (_REMOTORCH, _TORCH)
_DEPTH = 3  # frames kept: the first lines of the user's code and of the libraries it calls

Origin = tuple[tuple[object, int], ...]


def here(limit: int = _DEPTH) -> Origin:
    """The innermost ``limit`` frames of the calling thread outside remotorch and torch."""
    f = sys._getframe(1)
    out = []
    while f is not None and len(out) < limit:
        code = f.f_code
        if not code.co_filename.startswith(_SKIP) and not code.co_filename.startswith("<"):
            out.append((code, f.f_lineno))
        f = f.f_back
    return tuple(out)


def describe(origin: Origin) -> str:
    """``file:line in function`` of the innermost frame, with the frames around it (outermost last)."""
    if not origin:
        return "(issued inside remotorch)"
    lines = [f"{code.co_filename}:{line} in {code.co_name}" for code, line in origin]
    return lines[0] + "".join(f"\n    called from {more}" for more in lines[1:])


def first_line(origin: Origin) -> str:
    """``file:line`` of the innermost user frame (for trace events)."""
    if not origin:
        return ""
    code, line = origin[0]
    return f"{code.co_filename}:{line}"

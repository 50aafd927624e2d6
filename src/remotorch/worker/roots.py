"""The folders a worker reads weights from and writes checkpoints into, as its operator named them.

``remotorch serve --weights NAME=DIR`` (read only; may be repeated) and
``--checkpoints NAME=DIR`` (read and write). A client never sends a path of
this machine: it names ``NAME/relative/path``, and this module turns that into
a file it may open, or refuses (:class:`~remotorch.errors.PathRefusedError`):

* before anything is opened: an unknown root (or none at all), an empty,
  absolute or overlong name, a ``..`` or ``.`` or empty component, a NUL or
  other control character, a backslash, a ``%`` (percent escapes are never
  decoded, so a name that has one is refused whole);
* on resolving: a path whose real location (symlinks followed) is outside
  its container: the root, or for a hub-cache repository its own folder, so
  that the cache's snapshot-to-blob links stay allowed;
* on opening: anything but a regular file, a file whose name does not end in
  ``.safetensors`` or ``.json`` (a hub cache's ``refs/`` entries are read as
  40 hexadecimal digits, nothing else), and a file whose opened descriptor is
  not inside the container (a symlink swapped in between the check and the
  open is caught on what was actually opened).

Writes go only into ``--checkpoints`` roots, through a temporary file in the
same folder and a rename, so a reader never sees half a file.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ..errors import CheckpointError, PathRefusedError

ROOT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
MAX_NAME = 1024
READ_SUFFIXES = (".safetensors", ".json")
_OPEN_READ = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0) | \
    getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
_OPEN_WRITE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)


@dataclass(frozen=True)
class Root:
    """One named folder: ``path`` is its real path, taken when the worker started."""

    name: str
    path: str
    writable: bool


def parse_root(spec: str, writable: bool) -> Root:
    """``NAME=DIR`` as a root; ``ValueError`` when the name is not ``[A-Za-z0-9][A-Za-z0-9_.-]*`` or
    ``DIR`` is not a folder (checked at start-up, so a typo fails the worker, not a client later)."""
    name, sep, folder = spec.partition("=")
    if not sep or not folder or not ROOT_NAME.match(name):
        raise ValueError(f"{spec!r}: give NAME=DIR, NAME being letters, digits, '_', '.' or '-'")
    real = os.path.realpath(os.path.expanduser(folder))
    if not os.path.isdir(real):
        raise ValueError(f"{spec!r}: {folder!r} is not a folder")
    if writable and not os.access(real, os.W_OK | os.X_OK):
        raise ValueError(f"{spec!r}: {folder!r} is not writable by this worker")
    return Root(name, real, writable)


class Roots:
    """The roots of one worker, by name."""

    def __init__(self, roots: Iterable[Root] = ()) -> None:
        self._by_name: dict[str, Root] = {}
        for root in roots:
            if root.name in self._by_name:
                raise ValueError(f"the root name {root.name!r} is given twice")
            self._by_name[root.name] = root

    def __bool__(self) -> bool:
        return bool(self._by_name)

    def describe(self) -> dict[str, str]:
        """Each root's name and whether it is ``"read"`` or ``"write"`` (never its folder)."""
        return {name: "write" if r.writable else "read" for name, r in sorted(self._by_name.items())}

    def split(self, name: str, *, write: bool = False) -> tuple[Root, list[str]]:
        """The root ``name`` starts with and its other components, checked (nothing is opened)."""
        parts = check_name(name)
        if not self._by_name:
            raise PathRefusedError("this worker reads and writes no weights: its operator named no "
                                   "folders (remotorch serve --weights NAME=DIR, --checkpoints NAME=DIR)")
        root = self._by_name.get(parts[0])
        if root is None:
            raise PathRefusedError(f"{parts[0]!r} is not a root of this worker (it has: "
                                   f"{', '.join(self._by_name)})")
        if write and not root.writable:
            raise PathRefusedError(f"the root {root.name!r} is read-only (a --weights root); checkpoints "
                                   "go under a --checkpoints root")
        return root, parts[1:]


def check_name(name: str) -> list[str]:
    """``ROOT/rel/path`` split in components; :class:`PathRefusedError` for every refused form."""
    if not isinstance(name, str) or not name:
        raise PathRefusedError("an empty name")
    shown = repr(name[:80])
    if len(name) > MAX_NAME:
        raise PathRefusedError(f"a name of {len(name)} characters (at most {MAX_NAME})")
    if "\0" in name or any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise PathRefusedError(f"{shown}: a NUL or control character")
    if "\\" in name:
        raise PathRefusedError(f"{shown}: a backslash (components are separated by '/')")
    if "%" in name:
        raise PathRefusedError(f"{shown}: a '%' (percent escapes are never decoded; names are plain)")
    if name.startswith("/"):
        raise PathRefusedError(f"{shown}: an absolute path (name ROOT/relative/path, never a path of the "
                               "worker's machine)")
    parts = name.split("/")
    for p in parts:
        if p in ("", ".", ".."):
            raise PathRefusedError(f"{shown}: a {p!r} component" if p else f"{shown}: an empty component")
    return parts


def inside(path: str, container: str) -> bool:
    """``path`` (a real path) is ``container`` or below it."""
    return path == container or path.startswith(container.rstrip(os.sep) + os.sep)


def contained(path: str, container: str) -> str:
    """The real path of ``path``; refused when it resolves outside ``container``."""
    real = os.path.realpath(path)
    if not inside(real, container):
        raise PathRefusedError(f"{os.path.basename(path)!r} resolves outside its root (a symlink out of it)")
    return real


def _opened_path(fd: int) -> str | None:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


def _check_opened(fd: int, real: str, container: str) -> os.stat_result:
    """What was opened: a regular file inside ``container`` (refused otherwise)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise PathRefusedError(f"{os.path.basename(real)!r} is not a regular file")
    opened = _opened_path(fd)
    if opened is not None:
        if not inside(opened, container):
            raise PathRefusedError(f"{os.path.basename(real)!r} was replaced by a link out of its root")
    else:  # no /proc: the descriptor must be the file the checked path names now
        now = os.stat(real)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            raise PathRefusedError(f"{os.path.basename(real)!r} changed while it was opened")
    return st


def open_read(path: str, container: str, *, suffixes: tuple[str, ...] | None = READ_SUFFIXES) -> int:
    """A descriptor of the regular file ``path`` (its name ending in ``suffixes``), checked to be
    inside ``container`` both before and after opening; :class:`CheckpointError` if it is not there."""
    name = os.path.basename(path)
    if suffixes is not None and not name.endswith(suffixes):
        raise PathRefusedError(f"{name!r}: only {' and '.join(suffixes)} files are read")
    real = contained(path, container)
    try:
        fd = os.open(real, _OPEN_READ)
    except FileNotFoundError:
        raise CheckpointError(f"{name!r} is not there") from None
    except OSError as exc:
        raise PathRefusedError(f"{name!r} cannot be opened: {exc.strerror}") from None
    try:
        _check_opened(fd, real, container)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_small(path: str, container: str, limit: int, *, suffixes=READ_SUFFIXES) -> bytes:
    """The whole of a small file (JSON, a hub ref), at most ``limit`` bytes (refused above)."""
    fd = open_read(path, container, suffixes=suffixes)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise CheckpointError(f"{os.path.basename(path)!r} is {size} bytes, over the {limit} read for it")
        return os.pread(fd, size, 0)
    finally:
        os.close(fd)


def exists(path: str, container: str) -> bool:
    """Whether a file is at ``path`` (a link out of ``container`` counts as refused, not absent)."""
    if not os.path.lexists(path):
        return False
    contained(path, container)
    return os.path.exists(path)


# ------------------------------------------------------------------- writing
def make_folder(root: Root, parts: list[str]) -> str:
    """The folder ``parts`` under a writable ``root``, made as needed one level at a time, each level
    checked to be a real folder inside the root (never a link out)."""
    path = root.path
    for part in parts:
        path = os.path.join(path, part)
        try:
            os.mkdir(path, 0o755)
        except FileExistsError:
            pass
        real = contained(path, root.path)
        if not os.path.isdir(real):
            raise PathRefusedError(f"{part!r} exists and is not a folder")
    return os.path.realpath(path)


@contextmanager
def replacing(folder: str, name: str, container: str) -> Iterator[int]:
    """A descriptor to write ``folder/name`` through: a new temporary file beside it, synced and
    renamed over ``name`` when the block ends without an error (removed when it fails)."""
    if not name.endswith(READ_SUFFIXES) or "/" in name:
        raise PathRefusedError(f"{name!r}: only .safetensors and .json files are written")
    tmp = os.path.join(folder, f".{name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, _OPEN_WRITE, 0o644)
    done = False
    try:
        _check_opened(fd, tmp, container)
        yield fd
        os.fsync(fd)
        done = True
    finally:
        os.close(fd)
        if not done:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    os.replace(tmp, os.path.join(folder, name))


def write_all(fd: int, data) -> None:
    """Write every byte of ``data`` (a buffer) at the descriptor's position."""
    view = memoryview(data).cast("B")
    while view.nbytes:
        n = os.write(fd, view[: 1 << 30])
        view = view[n:]

"""What a name of weights stands for on this worker: which safetensors files, and which JSON beside them.

A client names ``ROOT/relative/path`` (:mod:`remotorch.worker.roots` checks
the name). The path may be:

* a ``.safetensors`` file;
* a folder ``save_pretrained`` wrote: ``model.safetensors``, or shards listed
  by ``model.safetensors.index.json`` (a folder with one ``.safetensors`` file of
  another name, as diffusers writes, works too);
* when ``ROOT`` is a Hugging Face hub cache, ``org/repo`` (or ``repo``) with a
  revision (a branch, a tag or a commit; ``main`` when none is given). It is
  resolved offline, as ``huggingface_hub`` does: ``models--org--repo/refs/<revision>``
  holds the commit, ``snapshots/<commit>/`` the files, as links to
  ``../../blobs/<hash>`` that stay inside the repository's folder. A snapshot
  that lacks a shard its index lists is refused, naming what it lacks.

Only ``.safetensors`` and ``.json`` files are ever opened; a folder holding
pickles (``pytorch_model.bin``…) and no safetensors is refused, saying so.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import msgspec

from ..errors import CheckpointError, PathRefusedError
from .roots import Roots, check_name, contained, exists, read_small

COMMIT = re.compile(r"^[0-9a-f]{40}$")
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_JSON = 64 << 20  # an index of a large model is some MB
PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".h5", ".msgpack", ".gguf")


@dataclass(frozen=True)
class Source:
    """A resolved weights name: every file opened for it must be inside ``container``."""

    label: str  # the name the client gave (for messages)
    container: str  # the root, or a hub repository's folder
    folder: str  # the folder the files are in
    files: tuple[str, ...]  # the safetensors files, relative to ``folder``
    weight_map: dict | None  # key -> file, for sharded weights
    revision: str = ""  # the commit of a hub-cache snapshot

    def path(self, name: str) -> str:
        return os.path.join(self.folder, name)

    def json_text(self, name: str) -> str:
        """The text of a JSON file beside the weights (``config.json``…), "" when there is none."""
        path = self.path(name)
        if not exists(path, self.container):
            return ""
        raw = read_small(path, self.container, MAX_JSON)
        try:
            msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:
            raise CheckpointError(f"{self.label}: {name} is not JSON: {exc}") from None
        return raw.decode("utf-8")


def resolve(roots: Roots, name: str, revision: str = "") -> Source:
    """The files ``name`` stands for (refused or missing: a typed error before any tensor is read)."""
    root, parts = roots.split(name)
    if not parts:
        raise PathRefusedError(f"{name!r} names a whole root: name a file or folder under it")
    repo = _hub_repo(root.path, parts)
    if repo is not None:
        folder, commit = _snapshot(repo, revision, name)
        return _folder(name, repo, folder, commit)
    if revision:
        raise PathRefusedError(f"revision= is for a hub-cache repository (ROOT/org/repo); {name!r} is not one")
    path = os.path.join(root.path, *parts)
    if not os.path.lexists(path):
        raise CheckpointError(f"{name!r} is not there")
    real = contained(path, root.path)
    if os.path.isdir(real):
        return _folder(name, root.path, path, "")
    if not parts[-1].endswith(".safetensors"):
        raise PathRefusedError(f"{name!r}: only .safetensors files (or folders of them) are read")
    return Source(name, root.path, os.path.dirname(path), (parts[-1],), None)


def _folder(label: str, container: str, folder: str, revision: str) -> Source:
    index = os.path.join(folder, INDEX)
    if exists(index, container):
        weight_map = _weight_map(label, read_small(index, container, MAX_JSON))
        files = tuple(sorted(set(weight_map.values())))
        lacking = [f for f in files if not exists(os.path.join(folder, f), container)]
        if lacking:
            raise CheckpointError(f"{label}: incomplete: {INDEX} lists {len(lacking)} file(s) that are not "
                                  f"there: {', '.join(lacking[:10])}")
        return Source(label, container, folder, files, weight_map, revision)
    if exists(os.path.join(folder, SINGLE), container):
        return Source(label, container, folder, (SINGLE,), None, revision)
    names = sorted(os.listdir(folder))
    found = [n for n in names if n.endswith(".safetensors") and not n.startswith(".")]
    if len(found) == 1:
        return Source(label, container, folder, tuple(found), None, revision)
    if found:
        raise CheckpointError(f"{label}: {len(found)} .safetensors files and no {INDEX}: name one "
                              f"({', '.join(found[:5])})")
    pickles = [n for n in names if n.endswith(PICKLES)]
    if pickles:
        raise PathRefusedError(f"{label}: holds {', '.join(pickles[:5])} and no .safetensors file; only "
                               "safetensors are read (never pickles): save it with save_pretrained, "
                               "whose default is safetensors")
    raise CheckpointError(f"{label}: no .safetensors file there")


def _weight_map(label: str, raw: bytes) -> dict[str, str]:
    try:
        doc = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise CheckpointError(f"{label}: {INDEX} is not JSON: {exc}") from None
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise CheckpointError(f"{label}: {INDEX} has no weight_map of strings")
    for file in set(wm.values()):
        check_name(file)  # a relative path, no '..', no escapes: checked before it is opened
        if not file.endswith(".safetensors"):
            raise PathRefusedError(f"{label}: {INDEX} lists {file[:80]!r}; only .safetensors files are read")
    return wm


# ---------------------------------------------------------------- the hub cache
def _hub_repo(root: str, parts: list[str]) -> str | None:
    """The repository folder ``models--org--repo`` of a hub cache root, if ``parts`` names one."""
    if not 1 <= len(parts) <= 2:
        return None
    folder = os.path.join(root, "models--" + "--".join(parts))
    if not os.path.lexists(folder):
        return None
    real = contained(folder, root)
    return real if os.path.isdir(real) else None


def _snapshot(repo: str, revision: str, label: str) -> tuple[str, str]:
    """The snapshot folder of ``revision`` (a commit, or a ref in ``refs/``) and its commit."""
    rev = revision or "main"
    if COMMIT.match(rev):
        commit = rev
    else:
        check_name(rev)  # a ref: no '..', no escapes; may hold '/' (refs/pr/1)
        ref = os.path.join(repo, "refs", rev)
        if not os.path.lexists(ref):
            raise CheckpointError(f"{label}: no revision {rev!r} in this cache (no refs/{rev}); give a "
                                  "branch, tag or commit that was downloaded")
        commit = read_small(ref, repo, 128, suffixes=None).decode("ascii", "replace").strip()
        if not COMMIT.match(commit):
            raise CheckpointError(f"{label}: refs/{rev} does not hold a commit")
    folder = os.path.join(repo, "snapshots", commit)
    if not os.path.lexists(folder):
        raise CheckpointError(f"{label}: commit {commit} ({rev}) is not in this cache (no snapshot)")
    real = contained(folder, repo)
    if not os.path.isdir(real):
        raise CheckpointError(f"{label}: snapshots/{commit} is not a folder")
    return folder, commit

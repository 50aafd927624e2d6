"""The messages of weights the worker reads and writes itself (protocol.md §22): loading a model's
tensors from files under the roots its operator named, and saving checkpoints there.

A client never names a path of the worker's machine: it names ``ROOT/relative/path``, where
``ROOT`` is one of the names the operator gave (``remotorch serve --weights NAME=DIR``,
``--checkpoints NAME=DIR``). Only safetensors and JSON files are read or written.

They live beside :mod:`remotorch.codec.messages`, which takes them into its
``Request`` and ``Reply`` unions; import them from there (``m.OpenWeights``).
"""

from __future__ import annotations

from typing import Union

import msgspec

from .args import HandleArg, RefArg, SlotArg, TensorArg, ViewArg
from .training import Hyper

MAX_SHARD_BYTES = 5 << 30  # a saved checkpoint's files are split above this size (transformers' old default)


class TensorSpec(msgspec.Struct, frozen=True, array_like=True):
    """A tensor's wire dtype name (protocol.md §10.1) and shape."""

    dtype: str
    shape: list[int]


class OpenWeights(msgspec.Struct, frozen=True, tag="open_weights", omit_defaults=True):
    """Resolve ``source`` under the worker's roots and answer what it holds, reading no tensor data:
    its keys, their dtypes and shapes (from the safetensors headers) and its ``config.json``."""

    source: str
    revision: str = ""  # a hub-cache source: a branch, tag or commit ("" = main)


class WeightsIndex(msgspec.Struct, frozen=True, tag="weights_index", omit_defaults=True):
    """What a weights source holds; ``revision`` is the commit a hub-cache source resolved to (the
    client sends it back with ``LoadWeights``, so both read the same snapshot)."""

    keys: list[str]
    specs: list[TensorSpec]
    nbytes: int  # the tensors' bytes in the files
    files: list[str]  # the safetensors files, relative to the source
    revision: str = ""
    config: str = ""  # config.json's text, if the source has one
    generation_config: str = ""  # generation_config.json's text, if any
    metadata: dict[str, str] = {}  # the first file's ``__metadata__``


class LoadWeights(msgspec.Struct, frozen=True, tag="load_weights", omit_defaults=True):
    """Read ``keys`` of ``source`` into new handles of this session (``handles[i]`` for
    ``keys[i]``), each cast to ``specs[i].dtype`` after its shape is checked against ``specs[i].shape``."""

    source: str
    keys: list[str]
    handles: list[int]
    specs: list[TensorSpec]
    revision: str = ""


WeightValue = Union[HandleArg, ViewArg, SlotArg, RefArg, TensorArg]


class SaveWeights(msgspec.Struct, frozen=True, tag="save_weights", omit_defaults=True):
    """Write ``values`` as a safetensors checkpoint under ``keys`` into the folder ``target`` (under a
    ``--checkpoints`` root), with ``config.json`` / ``generation_config.json`` when given."""

    target: str
    keys: list[str]
    values: list[WeightValue]
    config: str = ""
    generation_config: str = ""
    max_shard_bytes: int = MAX_SHARD_BYTES
    metadata: dict[str, str] = {}  # added to the files' ``__metadata__`` (``format`` is always ``pt``)


class SaveReply(msgspec.Struct, frozen=True, tag="save_reply", omit_defaults=True):
    """The files a save wrote, relative to its target, and the tensors' bytes."""

    files: list[str]
    nbytes: int


class SaveOptimizer(msgspec.Struct, frozen=True, tag="save_optim", omit_defaults=True):
    """Write optimizer ``optim``'s state and hyperparameters as the safetensors file ``target``."""

    target: str
    optim: int


class LoadOptimizer(msgspec.Struct, frozen=True, tag="load_optim", omit_defaults=True):
    """Replace optimizer ``optim``'s state and hyperparameters with those of the file ``source``."""

    source: str
    optim: int
    revision: str = ""


class OptimLoaded(msgspec.Struct, frozen=True, tag="optim_loaded", omit_defaults=True):
    """Each parameter group's hyperparameters as loaded (the client's optimizer takes them)."""

    hyper: list[dict[str, Hyper]]

"""``remotorch.from_pretrained``: a transformers model built here on meta, its weights read by the worker.

It follows what ``transformers``' own ``from_pretrained`` does, step by step,
where it matters for the result: the config from the files' ``config.json``
(keyword arguments that name config attributes override them, the others go
to the model), the dtype (``"auto"`` by default on transformers 5: the config's,
else the files' first floating dtype), the model built by the class's own
``_from_config`` (so its non-persistent buffers, a rotary embedding's
``inv_freq``, are computed as transformers computes them), tied weights tied
by the model itself, the base-model prefix added or removed when a head model
loads a base checkpoint (or the reverse), the keys the class says may be
missing or extra, ``generation_config.json``, and ``eval()`` mode.

What differs, on purpose: nothing of the weights is read or held here, no
code from the repository runs (``trust_remote_code`` is refused), and the
model's ``forward`` is compiled for the worker on its first call
(:func:`compile_on_first_call`), unless it is already being compiled.
"""

from __future__ import annotations

import functools
import json
import os
import re
import tempfile

import torch
from torch import nn

from ..capture.backend import compile as remote_compile
from ..client.session import Session, default_session
from ..codec import messages as m
from ..codec.tensors import dtype_from_name
from ..errors import CheckpointError
from .load import load_planned, open_weights, plan
from .meta import init_empty_weights, tensors_of

# from_pretrained arguments that would read weights here, or run code from the repository
_REFUSED = {"trust_remote_code": "code from a repository never runs", "device_map": "the weights live on the worker",
            "quantization_config": "quantized loading is not supported", "state_dict": "the worker reads the files",
            "from_tf": "only safetensors are read", "from_flax": "only safetensors are read",
            "gguf_file": "only safetensors are read", "tp_plan": "the weights live on the worker"}
# arguments about where transformers would find files here: the worker's roots decide that
_IGNORED = ("low_cpu_mem_usage", "use_safetensors", "local_files_only", "cache_dir", "force_download", "token",
            "proxies", "weights_only", "_fast_init", "offload_folder", "offload_state_dict")


def from_pretrained(cls, source: str, *, session: Session | None = None, revision: str | None = None,
                    torch_dtype=None, **kwargs):
    """A transformers model whose weights the worker reads from ``source`` and keeps.

    ``cls`` is any transformers model class or ``Auto*`` class; ``source`` is
    ``ROOT/relative/path`` under a ``--weights`` (or ``--checkpoints``) root
    of the session's first worker: a ``save_pretrained`` folder (one file or
    sharded), or in a Hugging Face hub cache an ``org/repo`` at ``revision``
    (a branch, tag or commit). ``torch_dtype`` (or ``dtype``) and the other
    keyword arguments mean what they mean to ``cls.from_pretrained``.

    Two round trips, whatever the model's size; nothing of the weights is
    sent or kept here: its parameters and persistent buffers are stand-ins for
    values on the worker. Calling the model (or ``generate``) runs it there;
    ``torch.compile(model, backend="remotorch")``, ``RemoteOptimizer`` and
    :func:`remotorch.save` work on it; ``session.pull(model)`` brings its
    values here when asked.
    """
    for key in [k for k in kwargs if k in _REFUSED]:
        if kwargs[key]:
            raise ValueError(f"remotorch.from_pretrained: {key}= is not supported: {_REFUSED[key]}")
        del kwargs[key]
    for key in _IGNORED:
        kwargs.pop(key, None)
    dtype = kwargs.pop("dtype", None) if torch_dtype is None else torch_dtype
    kwargs.pop("dtype", None)
    session = session or default_session()
    index = open_weights(session, source, revision)
    config, model_kwargs = _config(cls, index, kwargs, source)
    dtype = _dtype(dtype, config, index)
    with init_empty_weights():
        model = _build(cls, config, dtype, model_kwargs)
    model.eval()
    weights = tensors_of(model)
    rename, extra = _prefix(model, [k for w in weights for k in w.keys], index.keys)
    missing = _patterns(model, "_keys_to_ignore_on_load_missing")
    unexpected = _patterns(model, "_keys_to_ignore_on_load_unexpected")
    p = plan(weights, index, rename=rename, source=source, ignore_missing=missing,
             ignore_unexpected=lambda k: extra(k) or unexpected(k))
    load_planned(session, p, source, index.revision)
    if index.generation_config and getattr(model, "generation_config", None) is not None:
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_dict(json.loads(index.generation_config))
    compile_on_first_call(model, session)
    return model


def _config(cls, index: m.WeightsIndex, kwargs: dict, source: str):
    """The model's config from the worker's ``config.json`` (or ``config=``), and the other kwargs."""
    given = kwargs.pop("config", None)
    if given is not None and not isinstance(given, str):
        return given, kwargs
    if not index.config:
        raise CheckpointError(f"{source}: has no config.json to build the model from (give config=)")
    from transformers import AutoConfig

    config_class = getattr(cls, "config_class", None)
    if config_class is None or not hasattr(config_class, "from_pretrained"):
        config_class = AutoConfig
    with tempfile.TemporaryDirectory(prefix="remotorch-config-") as folder:
        with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
            f.write(index.config)
        config, rest = config_class.from_pretrained(folder, return_unused_kwargs=True, **kwargs)
    return config, rest


def _dtype(dtype, config, index: m.WeightsIndex) -> torch.dtype:
    """The dtype transformers would load the model in (see ``transformers.modeling_utils._get_dtype``)."""
    import transformers

    if dtype is None:
        dtype = "auto" if int(transformers.__version__.split(".")[0]) >= 5 else torch.get_default_dtype()
    if isinstance(dtype, str) and dtype == "auto":
        found = getattr(config, "dtype", None) if hasattr(config, "dtype") else getattr(config, "torch_dtype", None)
        if isinstance(found, str) and hasattr(torch, found):
            found = getattr(torch, found)
        if isinstance(found, torch.dtype):
            return found
        dtypes = [dtype_from_name(s.dtype) for s in index.specs]
        return next((d for d in dtypes if d.is_floating_point), dtypes[0] if dtypes else torch.get_default_dtype())
    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"dtype {dtype!r} is not 'auto' or a torch dtype")
        return getattr(torch, dtype)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be a torch.dtype, its name or 'auto', got {dtype!r}")
    return dtype


def _build(cls, config, dtype: torch.dtype, model_kwargs: dict) -> nn.Module:
    if hasattr(cls, "from_config") and not hasattr(cls, "_from_config"):  # an Auto class
        return cls.from_config(config, dtype=dtype, **model_kwargs)
    return cls._from_config(config, dtype=dtype, **model_kwargs)


def _prefix(model: nn.Module, model_keys: list[str], file_keys: list[str]):
    """How the model's keys map to the files' when one has the base-model prefix and the other not,
    and which file keys that leaves out on purpose (a head the base model has not)."""
    prefix = getattr(model, "base_model_prefix", "")
    if not prefix:
        return None, lambda k: False
    dotted = prefix + "."
    model_has = any(k.startswith(dotted) for k in model_keys)
    files_have = any(k.startswith(dotted) for k in file_keys)
    if model_has and not files_have:  # a head model, a base checkpoint
        return (lambda k: k[len(dotted):] if k.startswith(dotted) else k), lambda k: False
    if files_have and not model_has:  # a base model, a head model's checkpoint: its head stays out
        return (lambda k: dotted + k), lambda k: not k.startswith(dotted)
    return None, lambda k: False


def _patterns(model: nn.Module, name: str):
    found = [re.compile(p) for p in getattr(model, name, None) or ()]
    return lambda k: any(p.search(k) for p in found)


# ------------------------------------------------------------------ compiling
def compile_on_first_call(model: nn.Module, session: Session) -> None:
    """Compile ``model.forward`` for the session's worker when it is first called.

    A user's own ``torch.compile(model, ...)`` (or :func:`remotorch.compile`)
    traces through it to the original ``forward``, so compiling the model
    again works as for any model. Failures raise (never a quiet local run:
    the weights are on the worker).
    """
    forward = model.forward
    compiled: list = []

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if torch.compiler.is_compiling():  # being traced (the user's own compile): plain forward
            return forward(*args, **kwargs)
        if not compiled:
            compiled.append(remote_compile(forward, session=session, fallback="raise"))
        return compiled[0](*args, **kwargs)

    run.__remotorch_forward__ = forward
    model.forward = run

"""The onnxrt engine: export the aten graph to ONNX, run it with ONNX Runtime.

The graph is exported with ``torch.onnx.export(dynamo=True)``; every size the
document marks symbolic (and every integer scalar input) becomes a dynamic
axis, so one export serves every batch size. CPU workers use the CPU
execution provider with the worker's thread count; CUDA workers use the CUDA
execution provider when the installed ONNX Runtime has it. A graph the
exporter or ONNX Runtime cannot take raises here, which the worker reports as
a compile failure for this engine only.

Custom operators (of namespaces the worker allows) export through the ONNX
translations their library ships, where :data:`TRANSLATIONS` knows one
(transformers translates its ``grouped_mm_fallback``); for others the export
fails and so does this engine, for that graph.

The exporter logs a warning per skipped torchvision operator on every export
(four per graph where torchvision is not installed); :func:`quiet_exporter`
demotes that noise to debug records of this module's logger, and leaves every
other warning of the exporter as it is.
"""

from __future__ import annotations

import importlib
import logging
import warnings

import numpy as np
import torch

log = logging.getLogger(__name__)

# Namespace -> (module, attribute) of the translation table its library ships: OpOverload -> onnxscript function.
TRANSLATIONS = {"transformers": ("transformers.exporters.exporter_onnx", "_ONNX_TRANSLATION_TABLE")}


def _providers() -> list[str]:
    import onnxruntime

    return list(onnxruntime.get_available_providers())


def available(device: torch.device) -> bool:
    if device.type == "cpu":
        return "CPUExecutionProvider" in _providers()
    return device.type == "cuda" and "CUDAExecutionProvider" in _providers()


log = logging.getLogger(__name__)

# (logger, message start) of third-party records that say nothing to a remotorch user
NOISE = (("torch.onnx._internal.exporter._registration", "torchvision is not installed"),)


class _Demote(logging.Filter):
    """Drops the records a logger emits that start with ``prefix``, re-logging them at debug level."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith(self.prefix):
            log.debug("%s: %s", record.name, message)
            return False
        return True


def quiet_exporter() -> None:
    """Put the :data:`NOISE` filters on their loggers (once; later calls find them there)."""
    for name, prefix in NOISE:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Demote) and f.prefix == prefix for f in logger.filters):
            logger.addFilter(_Demote(prefix))


def compile(graph, device: torch.device, example_args, artifacts=None):
    """An ONNX Runtime callable for the graph; the exported model is kept in ``artifacts`` and
    taken from there next time (export is most of the compile time)."""
    module = graph.module.to(device).eval()  # nn.Module.eval(): inference mode; no Python eval
    options = _export_options(graph)
    model = artifacts.get(options) if artifacts is not None else None
    if model is None:
        model = _export(graph, module, example_args)
        if artifacts is not None:
            artifacts.put(options, model)
    return _session(model, module, device, example_args)


def _export_options(graph) -> str:
    """What an exported model depends on besides the graph: the exporter's and ONNX's versions."""
    from importlib import metadata

    versions = [f"{p}={metadata.version(p)}" for p in ("onnx", "onnxscript")]
    return "|".join([f"torch={torch.__version__}", *versions, *sorted(graph.custom_ops)])


def _export(graph, module, example_args) -> bytes:
    """The ONNX model of the graph (serialized protobuf: a format ONNX Runtime parses, never unpickles)."""
    quiet_exporter()
    dynamic = _dynamic_shapes(graph.inputs, example_args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            program = torch.onnx.export(module, tuple(example_args), dynamo=True, dynamic_shapes=dynamic,
                                        verbose=False, report=False,
                                        custom_translation_table=_translations(graph.custom_ops) or None)
        except Exception as exc:  # the exporter's own message is pages long: name the root cause
            root = exc
            while root.__cause__ is not None:
                root = root.__cause__
            first = str(root).strip().splitlines()[0] if str(root).strip() else ""
            raise OnnxExportError(f"{type(root).__name__}: {first[:300]}") from exc
    return program.model_proto.SerializeToString()


def _session(model: bytes, module, device: torch.device, example_args):
    """An ONNX Runtime session of ``model``, tried once on the example arguments."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    if device.type == "cuda":
        providers = [("CUDAExecutionProvider", {"device_id": device.index or 0})]
    else:
        providers = ["CPUExecutionProvider"]
    session = onnxruntime.InferenceSession(model, options, providers=providers)
    run = _OrtCallable(session, device, len(example_args))
    with torch.no_grad():
        expected = module(*example_args)
        got = run(*example_args)  # fails here, not on a timed run, if ONNX Runtime cannot run it
    if len(got) != len(expected if isinstance(expected, (list, tuple)) else [expected]):
        raise ValueError("the ONNX model's outputs do not match the graph's outputs")
    return run


def _translations(custom_ops) -> dict:
    """ONNX translations of the graph's custom operators that their libraries ship (only theirs:
    a library's table may also override aten operators, which stay torch's own here)."""
    table = {}
    for ns in sorted({name.partition("::")[0] for name in custom_ops}):
        where = TRANSLATIONS.get(ns)
        if where is None:
            continue
        try:
            found = getattr(importlib.import_module(where[0]), where[1])
        except Exception:  # no translations installed: the export names the operator it lacks
            log.debug("no ONNX translations from %s", where[0], exc_info=True)
            continue
        table.update({op: fn for op, fn in found.items()
                      if isinstance(op, torch._ops.OpOverload) and op.namespace == ns})
    return table


class OnnxExportError(RuntimeError):
    """The graph could not be exported to ONNX (the message names the root cause)."""


def _dynamic_shapes(inputs: list[dict], example_args) -> tuple:
    """Symbolic sizes in the document become dynamic axes; integer scalars dynamic too."""
    from torch.export import Dim

    spec = []
    for meta, arg in zip(inputs, example_args):
        if meta.get("kind") == "tensor":
            dims = {i: Dim.DYNAMIC for i, d in enumerate(meta.get("shape") or []) if isinstance(d, str)}
            spec.append(dims or None)
        elif isinstance(arg, int) and not isinstance(arg, bool):
            spec.append(Dim.DYNAMIC)
        elif arg is None:
            spec.append(None)
        else:  # a float or bool input would be baked into the model as a constant: refuse
            raise ValueError(f"graph input of type {type(arg).__name__} cannot be an ONNX input")
    return tuple(spec)


class _OrtCallable:
    """Calls an ONNX Runtime session with the graph's flat arguments; returns torch tensors."""

    def __init__(self, session, device: torch.device, nargs: int) -> None:
        self._session = session
        self._device = device
        names = [i.name for i in session.get_inputs()]
        # the exporter names inputs after the graph's placeholders (arg0, arg1, …) and may drop unused ones
        self._inputs = [(name, int(name[3:]) if name.startswith("arg") and name[3:].isdigit() else pos)
                        for pos, name in enumerate(names)]
        self._outputs = [o.name for o in session.get_outputs()]
        if any(index >= nargs for _, index in self._inputs):
            raise ValueError("the ONNX model has inputs the graph does not have")

    def __call__(self, *args) -> list:
        if self._device.type == "cuda":
            return self._run_cuda(args)
        feeds = {name: _to_numpy(args[index]) for name, index in self._inputs}
        return [torch.from_numpy(np.ascontiguousarray(o)) for o in self._session.run(self._outputs, feeds)]

    def _run_cuda(self, args) -> list:
        binding = self._session.io_binding()
        keep = []
        for name, index in self._inputs:
            value = args[index]
            if isinstance(value, torch.Tensor):
                value = value.contiguous()
                keep.append(value)
                binding.bind_input(name, "cuda", self._device.index or 0, _NP_DTYPES[value.dtype],
                                   list(value.shape), value.data_ptr())
            else:
                binding.bind_cpu_input(name, _to_numpy(value))
        for name in self._outputs:
            binding.bind_output(name, "cuda", self._device.index or 0)
        self._session.run_with_iobinding(binding)
        return [torch.from_numpy(o).to(self._device) for o in binding.copy_outputs_to_cpu()]


_NP_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
              torch.int64: np.int64, torch.int32: np.int32, torch.int8: np.int8, torch.uint8: np.uint8,
              torch.bool: np.bool_}


def _to_numpy(value):
    if isinstance(value, torch.Tensor):
        return value.detach().contiguous().numpy()
    if isinstance(value, bool) or value is None:
        return np.asarray(value)
    return np.asarray(value, dtype=np.int64 if isinstance(value, int) else np.float32)

"""Split a model into pipeline stages: one whole-model capture, cut by the submodule each node came from.

The model and its loss are traced together as one graph (TorchDynamo,
``fullgraph=True``) on one microbatch. Dynamo records on every node the
stack of modules it ran inside (``nn_module_stack``); a node belongs to the
stage of the last ``split_before`` submodule entered at or before it, so
code between submodules and the loss go with the stage they follow, and no
graph break is needed between stages. ``torch.fx``'s ``split_module`` then
turns the stages into submodules whose inputs name where each value comes
from: the microbatch, a parameter, or an output of an earlier stage (not
only the previous one: skip connections across stages are ordinary edges).

Each stage is lowered by aot_autograd, ahead of time and on fake tensors,
into a forward graph (its outputs, then what it saves for backward) and a
backward graph (saved values and output gradients in, input gradients out).
The pipeline runs those graphs itself on the workers, so activations and
gradients move stage to stage without local autograd in between.
"""

from __future__ import annotations

import operator
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..errors import UnsupportedGraphError


class PipelineSplitError(UnsupportedGraphError):
    """The model cannot be split into pipeline stages as asked."""


@dataclass(frozen=True)
class Source:
    """Where a stage input comes from: ``kind`` "input" (microbatch leaf ``index``), "target",
    "param" / "buffer" (``name``), "stage" (output ``index`` of stage ``stage``) or "const"."""

    kind: str
    index: int = 0
    stage: int = -1
    name: str = ""


@dataclass
class StageGraphs:
    """One stage lowered for training: its forward and backward aten graphs and their wiring."""

    index: int
    inputs: list[Source]  # one per forward graph input, in order
    tensors: list  # the parameter/buffer tensor of each "param"/"buffer" input (None otherwise)
    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule
    n_outputs: int  # forward outputs before the saved ones
    output_meta: list  # (dtype, shape, requires_grad) of each of those outputs
    tangent_of: list[int]  # backward's output-gradient inputs: which forward output each is for
    n_saved: int
    consumers: dict[int, list[int]] = field(default_factory=dict)  # output -> stages that take it

    @property
    def params(self) -> list[int]:
        return [i for i, s in enumerate(self.inputs) if s.kind == "param"]


@dataclass
class Split:
    """A model cut into stages: what each stage runs, and the loss's place."""

    stages: list[StageGraphs]
    n_inputs: int
    param_names: dict[int, str]  # id(parameter) -> qualified name


def _module_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(mod): name for name, mod in model.named_modules()}


def assign_stages(gm: torch.fx.GraphModule, model: torch.nn.Module, split_before: Sequence[str]) -> dict:
    """Node -> stage: the number of ``split_before`` submodules entered at or before the node."""
    names = _module_names(model)
    unknown = [s for s in split_before if s not in names.values()]
    if unknown:
        raise PipelineSplitError(f"split_before names no submodule of the model: {unknown} "
                                 f"(names look like {next(iter(n for n in names.values() if '.' in n), 'layers.0')!r})")
    order = {s: i + 1 for i, s in enumerate(split_before)}
    stage, part, seen = 0, {}, set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        for key, value in (node.meta.get("nn_module_stack") or {}).items():
            name = names.get(int(key)) if str(key).isdigit() else _from_source(value, names)
            for split, k in order.items():
                if name is not None and (name == split or name.startswith(split + ".")):
                    stage = max(stage, k)
                    seen.add(split)
        part[node] = stage
    missing = [s for s in split_before if s not in seen]
    if missing:
        raise PipelineSplitError(f"no traced operation ran inside {missing}: a stage would be empty")
    return part


def _from_source(value, names) -> str | None:
    """A module's qualified name from the ``L['self'].layers[4]`` form some versions record."""
    path = value[0] if isinstance(value, tuple) else None
    if not isinstance(path, str):
        return None
    path = path.replace("]", "").replace("[", ".").replace("'", "")
    parts = path.split(".")[1:]  # drop the root (L / G / self)
    for k in range(len(parts)):
        candidate = ".".join(parts[k:])
        if candidate in names.values():
            return candidate
    return None


# --------------------------------------------------------------------- capture
def capture(model: torch.nn.Module, loss_fn: Callable, args: tuple | dict, target) -> tuple:
    """Trace ``loss_fn(model(*args), target)`` (``model(**args)`` for a dict) as one graph; returns
    (graph module, example inputs)."""
    got: dict = {}

    def backend(gm, example_inputs):
        got["gm"], got["inputs"] = gm, list(example_inputs)
        out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
        vals = [v.meta.get("example_value") for v in (out if isinstance(out, (tuple, list)) else [out])]

        def placeholder_outputs(*_):  # dynamo calls the result once: nothing needs to run here
            return tuple(torch.zeros(v.shape, dtype=v.dtype) for v in vals)
        return placeholder_outputs

    def trace(a, t):
        return loss_fn(model(**a) if isinstance(a, dict) else model(*a), t)
    # a fresh code object per capture: dynamo's cache (and its recompile limit) is per code object
    fresh = types.FunctionType(trace.__code__.replace(), trace.__globals__, "remotorch_pipeline_trace",
                               None, trace.__closure__)
    try:
        torch.compile(fresh, backend=backend, fullgraph=True, dynamic=False)(args, target)
    except Exception as exc:
        raise PipelineSplitError(f"the model and loss could not be traced as one graph "
                                 f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from exc
    return got["gm"], got["inputs"]


def split_model(model: torch.nn.Module, loss_fn: Callable, split_before: Sequence[str], args: tuple,
                target) -> Split:
    """Capture, cut into ``len(split_before) + 1`` stages, and lower each stage to forward/backward graphs."""
    from torch.fx.passes.split_module import split_module

    gm, example_inputs = capture(model, loss_fn, args, target)
    part = assign_stages(gm, model, split_before)
    n_stages = len(split_before) + 1
    used = set(part.values())
    if used != set(range(n_stages)):
        raise PipelineSplitError(f"stages {sorted(set(range(n_stages)) - used)} would be empty")
    top = split_module(gm, model, lambda n: part[n], keep_original_order=True)
    leaves = [t for t in (*_leaves(args), *_leaves(target))]
    params = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    buffers = {id(b): n for n, b in model.named_buffers(remove_duplicate=False)}
    sources: dict = {}
    placeholders = [n for n in top.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs):
        sources[node] = _placeholder_source(value, leaves, params, buffers, len(_leaves(args)))
    stages = _lower_stages(top, placeholders, example_inputs, sources, n_stages)
    return Split(stages, len(_leaves(args)), {**params})


def _leaves(x) -> list:
    import torch.utils._pytree as pytree
    return [v for v in pytree.tree_leaves(x) if isinstance(v, torch.Tensor)]


def _placeholder_source(value, leaves, params, buffers, n_args) -> Source:
    for i, leaf in enumerate(leaves):
        if value is leaf:
            return Source("input", i) if i < n_args else Source("target", i - n_args)
    if id(value) in params:
        return Source("param", name=params[id(value)])
    if id(value) in buffers:
        return Source("buffer", name=buffers[id(value)])
    return Source("const")


def _lower_stages(top, placeholders, example_inputs, sources, n_stages) -> list[StageGraphs]:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = FakeTensorMode()
    fakes = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]
    calls = [n for n in top.graph.nodes if n.op == "call_module"]
    for n in calls:  # every stage returns a tuple (aot_autograd's calling convention)
        _tuple_outputs(getattr(top, n.target))
    _rewire_single_outputs(top, calls)
    _one_consumer_per_output(top, calls)
    FakeTensorProp(top, mode).propagate(*fakes)
    values = dict(zip(placeholders, fakes))
    tensor_of = dict(zip(placeholders, example_inputs))
    stage_of_call = {n: int(n.target.rsplit("_", 1)[1]) for n in calls}
    lowered = []
    for k, n in enumerate(sorted(calls, key=lambda c: stage_of_call[c])):
        if stage_of_call[n] != k:
            raise PipelineSplitError("stages are not in order in the traced graph")
        inputs, tensors = [], []
        for a in n.args:
            if a in sources:
                src = sources[a]
                if src.kind == "const":
                    raise PipelineSplitError(f"stage {k} takes a tensor that is neither an input, a parameter "
                                             "nor a buffer of the model")
                inputs.append(src)
                tensors.append(tensor_of[a] if src.kind in ("param", "buffer") else None)
            elif a.op == "call_function" and a.target is operator.getitem and a.args[0] in stage_of_call:
                inputs.append(Source("stage", a.args[1], stage_of_call[a.args[0]]))
                tensors.append(None)
            else:
                raise PipelineSplitError(f"stage {k} takes a value the splitter cannot place: {a}")
        fake_args = []
        for a, src in zip(n.args, inputs):
            if src.kind == "stage":  # an activation: needs a gradient when its producer's output does
                wants = lowered[src.stage].output_meta[src.index][2]
                fake_args.append(a.meta["val"].detach().requires_grad_(wants))
            else:
                fake_args.append(values[a])
        lowered.append(_lower(k, getattr(top, n.target), inputs, tensors, fake_args))
    _check_shared_params(lowered)
    for st in lowered:
        for src in st.inputs:
            if src.kind == "stage":
                lowered[src.stage].consumers.setdefault(src.index, []).append(st.index)
    last = lowered[-1]
    if last.n_outputs != 1 or last.output_meta[0][1] != ():
        raise PipelineSplitError("the last stage must end in the loss: loss_fn must return one scalar")
    return lowered


def _tuple_outputs(sub: torch.fx.GraphModule) -> None:
    out = [x for x in sub.graph.nodes if x.op == "output"][0]
    if not isinstance(out.args[0], (tuple, list)):
        out.args = ((out.args[0],),)
        sub.recompile()


def _rewire_single_outputs(top: torch.fx.GraphModule, calls) -> None:
    """Users of a stage's single (now tuple) output read item 0 of it."""
    for n in calls:
        users = list(n.users)
        if all(u.op == "call_function" and u.target is operator.getitem for u in users):
            continue
        with top.graph.inserting_after(n):
            item = top.graph.call_function(operator.getitem, (n, 0))
        for u in users:
            u.replace_input_with(n, item)
    top.recompile()


def _one_consumer_per_output(top: torch.fx.GraphModule, calls) -> None:
    """An output that several later stages take is returned once per taker (copies after the first).

    Each taker sends back its own gradient for it; as separate outputs the
    stage's backward graph adds them up itself.
    """
    for n in calls:
        sub = getattr(top, n.target)
        out = [x for x in sub.graph.nodes if x.op == "output"][0]
        results = list(out.args[0])
        for item in [u for u in list(n.users) if u.target is operator.getitem]:
            takers = [u for u in item.users if u.op == "call_module"]
            for taker in takers[1:]:
                with sub.graph.inserting_before(out):
                    copy = sub.graph.call_function(torch.clone, (results[item.args[1]],))
                results.append(copy)
                with top.graph.inserting_after(item):
                    extra = top.graph.call_function(operator.getitem, (n, len(results) - 1))
                taker.replace_input_with(item, extra)
        out.args = (tuple(results),)
        sub.recompile()
    top.recompile()


def _check_shared_params(stages: list[StageGraphs]) -> None:
    owner: dict[int, int] = {}
    for st in stages:
        for src, t in zip(st.inputs, st.tensors):
            if src.kind == "param" and owner.setdefault(id(t), st.index) != st.index:
                raise PipelineSplitError(
                    f"parameter {src.name!r} is used by stages {owner[id(t)]} and {st.index} (tied weights); "
                    "a parameter must belong to one stage: untie it (e.g. tie_word_embeddings=False) or "
                    "move the split so both uses fall in one stage")


def _lower(index: int, sub: torch.fx.GraphModule, inputs: list[Source], tensors: list,
           fake_args: list) -> StageGraphs:
    """aot_autograd on fake tensors: the stage's forward and backward graphs, both now."""
    import torch._functorch.config as fconfig
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode

    got: dict = {}

    def keep(kind):
        def compiler(g, _example):
            ctx = TracingContext.try_get()
            got[kind] = (g, getattr(ctx, "fw_metadata", None))
            return g.forward
        return compiler

    mode = next((a.fake_mode for a in fake_args if hasattr(a, "fake_mode")), FakeTensorMode())
    with fconfig.patch(force_non_lazy_backward_lowering=True), tracing(TracingContext(mode)):
        aot_module_simplified(sub, fake_args, fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                              inference_compiler=keep("inference"))
    if "backward" not in got:
        raise PipelineSplitError(f"stage {index} has nothing to train (no input needs a gradient)")
    fw, meta = got["forward"]
    bw, _ = got["backward"]
    return _wire(index, fw, bw, meta, inputs, tensors)


def _wire(index, fw, bw, meta, inputs, tensors) -> StageGraphs:
    from torch._functorch._aot_autograd.schemas import OutputType

    if meta is None or meta.num_mutated_inp_runtime_indices:
        raise PipelineSplitError(f"stage {index} changes its inputs in place (e.g. batch-norm statistics); "
                                 "pipeline stages must be functional")
    if any(o.output_type != OutputType.non_alias for o in meta.output_info):
        raise PipelineSplitError(f"stage {index} returns a view of its input or of another output; "
                                 "move the split point")
    n_out = len(meta.output_info)
    fw_out = [x for x in fw.graph.nodes if x.op == "output"][0].args[0]
    vals = [v.meta.get("val") for v in fw_out[:n_out]]
    if any(not isinstance(v, torch.Tensor) for v in vals):
        raise PipelineSplitError(f"stage {index} returns something that is not a tensor")
    saved = len(fw_out) - getattr(meta, "num_forward", n_out)
    bw_in = [p for p in bw.graph.nodes if p.op == "placeholder"]
    tangents = [p for p in bw_in if p.name.startswith("tangents")]
    if len(bw_in) - len(tangents) != saved or any(isinstance(v, torch.SymInt) for v in fw_out[n_out:]):
        raise PipelineSplitError(f"stage {index}: saved values do not match its backward (dynamic shapes?)")
    grad_outputs = [i for i, o in enumerate(meta.output_info) if o.requires_grad]
    if len(grad_outputs) != len(tangents):
        raise PipelineSplitError(f"stage {index}: cannot tell which output each output gradient is for")
    return StageGraphs(index=index, inputs=inputs, tensors=tensors, forward=fw, backward=bw, n_outputs=n_out,
                       output_meta=[(v.dtype, tuple(v.shape), o.requires_grad)
                                    for v, o in zip(vals, meta.output_info)],
                       tangent_of=grad_outputs, n_saved=saved)

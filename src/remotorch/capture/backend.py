"""The ``remotorch`` TorchDynamo backend.

Dynamo hands over a torch-level FX graph with parameters and buffers lifted
to inputs; aot_autograd lowers it to functional aten graphs (forward, and
backward when gradients are needed) and tells which inputs are static
(parameters/buffers). Each aten graph becomes a :class:`RemoteGraph`:
encoded once, uploaded once, its static inputs sent by content id.

Library custom operators (``torch.ops.transformers.grouped_mm_fallback``…)
stay in the aten graph by name; the worker runs them if it allows their
namespace. With ``custom_ops="decompose"`` those that have a decomposition
registered (``torch._decomp.register_decomposition``) are decomposed here,
into aten operators any worker runs.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable

import torch

from ..client.wiring import ensure as _join_parts
from ..codec.ops import CORE_NAMESPACES
from ..codec.rngstate import draws_random
from ..errors import UnsupportedGraphError
from .attention import device_only, rewrite_attention
from .graph import FALLBACKS, GraphRunner, RemoteGraph, output_devices
from .layout import Layouts

log = logging.getLogger(__name__)

CUSTOM_OPS = ("worker", "decompose")


# The runner graphs use when no session is given: ``remotorch.default_session``, set by the
# package root (capture never imports the session, so the client can change without it).
default_runner: Callable[..., GraphRunner | None] | None = None


def remotorch_backend(gm: torch.fx.GraphModule, example_inputs, *, session=None,
                      engine: str = "eager", fallback: str = "local", worker: int | str | None = None,
                      custom_ops: str = "worker", cuda_graphs: bool = False, options: dict | None = None):
    """Dynamo backend: run every captured graph on a remotorch worker.

    ``options`` (from ``torch.compile(..., options=...)``) may set
    ``session``, ``engine``, ``fallback``, ``worker``, ``custom_ops`` and
    ``cuda_graphs`` (the worker records each graph as a CUDA graph and replays
    it: ``worker/cudagraphs.py``).
    """
    from torch._dynamo.backends.common import aot_autograd

    opts = dict(options or {})
    session = opts.pop("session", session)
    engine = opts.pop("engine", engine)
    fallback = opts.pop("fallback", fallback)
    worker = opts.pop("worker", worker)
    custom_ops = opts.pop("custom_ops", custom_ops)
    cuda_graphs = bool(opts.pop("cuda_graphs", cuda_graphs))
    if opts:
        raise ValueError(f"unknown remotorch backend options: {sorted(opts)}")
    if fallback not in FALLBACKS:
        raise ValueError(f"fallback must be one of {FALLBACKS}, got {fallback!r}")
    if custom_ops not in CUSTOM_OPS:
        raise ValueError(f"custom_ops must be one of {CUSTOM_OPS}, got {custom_ops!r}")
    # the graphs aot_autograd makes of this one, each with whether it may run direct and how many
    # arguments it takes
    made: list[tuple[RemoteGraph, bool, int]] = []
    make = functools.partial(_compile_aten, session=session, engine=engine, fallback=fallback, worker=worker,
                             made=made, cuda_graphs=cuda_graphs)
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    extra = {"decompositions": custom_decompositions()} if custom_ops == "decompose" else {}
    device = _worker_device(session, worker)
    if device != "cpu":
        fused_attention(gm, session, worker)
    with _effect_tokens_inside(), portable_attention(device):
        # aot_eager's partitioner (torch/_dynamo/backends/debugging.py): it recomputes what is cheaper
        # to recompute than to save, so a forward saves what aot_eager's saves
        compiled = aot_autograd(fw_compiler=functools.partial(make, static=True, kind="forward"),
                                inference_compiler=functools.partial(make, static=True),
                                bw_compiler=functools.partial(make, static=False, kind="backward"),
                                partition_fn=min_cut_rematerialization_partition, **extra)(gm, example_inputs)
    if len(made) == 1 and made[0][1] and made[0][2] == len(example_inputs):  # dynamo's arguments, as they are
        return _placeholders_seen(_direct(made[0][0]))
    return _placeholders_seen(compiled)


def _effect_tokens_inside():
    """aot_autograd's config for graphs whose effect tokens are made and sunk inside them.

    An operator with a side effect (``aten._linalg_check_errors``, which
    raises when ``linalg.cholesky``, ``inv`` or ``solve`` met a singular
    matrix) runs as ``with_effects(token, op, …)``, threading a token that
    orders it among the others. By default the tokens are graph inputs and
    outputs (empty tensors, ``None`` at run time); here, as aot_autograd does
    for inductor, the graph makes them (``prims._make_token``) and sinks them
    (``prims._sink_tokens``), so nothing about them travels per call.
    """
    from torch._functorch import config as functorch_config

    return functorch_config.patch(unlift_effect_tokens=True)


def _placeholders_first(gm: torch.fx.GraphModule) -> None:
    """Move the calls found among a graph's placeholders after the last one (a document lists its
    inputs first). aot_autograd puts ``prims._make_token()`` where the token input it replaces was;
    a call there uses nothing after it, so moving it (and any like it, in order) changes nothing."""
    nodes = list(gm.graph.nodes)
    last = max((i for i, n in enumerate(nodes) if n.op == "placeholder"), default=0)
    early = [n for n in nodes[:last] if n.op != "placeholder"]
    anchor = nodes[last]
    for node in early:
        anchor.append(node)
        anchor = node
    if early:
        gm.recompile()


def _direct(graph: RemoteGraph):
    """The inference graph called with dynamo's arguments as they are, without aot_autograd's runtime.

    Only for a graph whose runtime would do nothing but call it (see
    :func:`_runs_direct`): the same arguments in the same order, the same
    outputs. That runtime costs about 20 µs a call, a tenth of a small
    model's remote call (``benchmarks/warm_call.py``).
    """
    def run(*args):
        grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)  # as aot_autograd runs an inference graph
        try:
            return graph(list(args))
        finally:
            torch._C._set_grad_enabled(grad)

    return run


def _runs_direct() -> bool:
    """Whether aot_autograd's runtime around this inference graph would only call it.

    It would do more for: mutated inputs (copied back), outputs that alias
    inputs or intermediates (rebuilt from their bases), intermediate bases,
    outputs marked dynamic, a grad mode the graph changes, functionalized
    RNG, effect tokens, tensor subclasses, autocast (turned off around the
    call), and arguments it adds, dedupes or merges (a module's own
    parameters, put before dynamo's; duplicates; aliased inputs): then the
    graph does not take exactly the arguments dynamo passes, which
    :func:`remotorch_backend` tells from the count of its placeholders.
    """
    from torch._functorch._aot_autograd.schemas import OutputType
    from torch._guards import TracingContext

    ctx = TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None) if ctx else None
    if meta is None or torch._C._is_any_autocast_enabled():
        return False
    return (meta.num_mutated_inp_runtime_indices == 0 and meta.num_intermediate_bases == 0
            and meta.num_outputs_aliased == 0 and not meta.dynamic_outputs
            and all(o.output_type == OutputType.non_alias for o in meta.output_info)
            and meta.grad_enabled_mutation is None and not meta.is_rng_op_functionalized
            and not meta.tokens and not any(mi.mutates_data or mi.mutates_metadata for mi in meta.input_info)
            and all(type(x).__name__ == "PlainTensorMeta" or isinstance(x, int)
                    for x in (*meta.subclass_inp_meta, *meta.subclass_fw_graph_out_meta)))


def _placeholders_seen(compiled):
    """``compiled`` run with tensor subclasses' torch functions on.

    Once dynamo traced a subclass's ``__torch_function__`` (a placeholder for
    a value kept on a worker, ``client.remote.RemoteTensor``), it runs the
    compiled graph with them off. But aot_autograd's runtime around our
    graphs works on their inputs and outputs locally (``detach``,
    ``_unsafe_view``, rebuilding aliases), and a placeholder must see that:
    with its torch function off, the result would be a plain tensor over its
    unwritten buffer. The graph itself runs remotely, so nothing is
    dispatched twice.
    """
    @functools.wraps(compiled)
    def run(*args):
        if torch._C._is_torch_function_enabled():
            return compiled(*args)
        with torch._C._EnableTorchFunction():
            return compiled(*args)

    return run


def _worker_device(session, worker) -> str:
    """The device type of the worker the graphs will run on ("cpu" when it cannot be asked now: the
    run reaches it later, or falls back)."""
    try:
        runner = session if session is not None else (default_runner() if default_runner else None)
        if hasattr(runner, "trace_device"):  # a runner for several workers at once (a profile)
            return runner.trace_device()
        device = runner.connection_for(worker).info().get("device", "cpu")
    except Exception:  # no worker yet: its graphs fail or fall back as any other call would
        return "cpu"
    return str(device).partition(":")[0]


def fused_attention(gm: torch.fx.GraphModule, session, worker) -> dict[str, int]:
    """Each attention call of the graph as the kernel the worker picks for it (``capture/attention.py``);
    how many went to each backend. A runner that cannot ask (a profile of several workers), or a
    worker that does not answer, leaves them as their math."""
    runner = session if session is not None else (default_runner() if default_runner else None)
    ask = getattr(runner, "attention_backends", None)
    if ask is None:
        return {}

    def choose(calls: list) -> list[str] | None:
        try:
            return ask(worker, calls)
        except Exception:  # an older worker, or none reachable now: traced as the math, which runs anywhere
            log.debug("the worker did not say which attention kernels it picks", exc_info=True)
            return None

    return rewrite_attention(gm, choose)


def portable_attention(device_type: str):
    """Where this process traces for another device: attention as its math, not this CPU's kernel.

    This process traces with fake tensors of its own device. On a CPU,
    ``scaled_dot_product_attention`` picks the CPU-only fused kernel
    (``_scaled_dot_product_flash_attention_for_cpu`` and its backward), which a
    CUDA worker cannot run. Traced with the math backend, the graph holds
    matrix products and a softmax, and its backward is derived from them: it
    runs on any device. A CPU worker keeps the fused kernel.
    """
    if device_type == "cpu":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])


def custom_decompositions() -> dict:
    """Decompositions registered for custom operators (not aten/prims), by operator overload.

    Libraries (and users) register them with
    ``torch._decomp.register_decomposition(op)``; an operator with a
    CompositeImplicitAutograd kernel is decomposed by aot_autograd anyway.
    """
    from torch._decomp import global_decomposition_table

    return {op: fn for op, fn in global_decomposition_table["post_autograd"].items()
            if isinstance(op, torch._ops.OpOverload) and op.namespace not in CORE_NAMESPACES}


def _static_indices(example_inputs) -> list[int]:
    from torch._guards import TracingContext
    ctx = TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None) if ctx else None
    indices = list(getattr(meta, "static_input_indices", None) or [])
    return [i for i in indices if i < len(example_inputs) and isinstance(example_inputs[i], torch.Tensor)]


def _saved_from() -> int | None:
    """Index of a training forward's first saved-for-backward output.

    aot_autograd's forward returns mutated inputs, user outputs and
    intermediate bases (``num_forward_returns``), then, with functionalized
    RNG, an offset (``num_forward``), and after those the tensors and symbolic
    sizes saved for backward.
    """
    from torch._guards import TracingContext
    ctx = TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None) if ctx else None
    n = getattr(meta, "num_forward", None)
    return n if isinstance(n, int) else getattr(meta, "num_forward_returns", None)


def _aliased_outputs(kind: str, n_outputs: int) -> tuple[frozenset[int], frozenset[int]]:
    """(outputs that must come back as real tensors, inputs to fetch before a run).

    aot_autograd's runtime works on some values locally, reading their memory
    directly: it copies mutated inputs' new values into them, and rebuilds
    outputs that alias an input or an intermediate from their base. Those
    outputs must be real, and an input an output aliases must be here. A
    backward graph's outputs are gradients, which the autograd engine works
    on in C++: they stand here as placeholders that read their value before
    any such operation (``client.remote.RemoteGrad``), so none must be real.
    """
    from torch._functorch._aot_autograd.schemas import OutputType
    from torch._guards import TracingContext

    everything = frozenset(range(n_outputs))
    if kind == "backward":  # gradients: placeholders the engine reads when it must (client.remote.RemoteGrad)
        return frozenset(), frozenset()
    ctx = TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None) if ctx else None
    if meta is None:
        return everything, frozenset()
    mutated = meta.num_mutated_inp_runtime_indices
    must_real, fetch_first = set(range(mutated)), set(meta.mutated_inp_runtime_indices)
    n_user = len(meta.output_info)
    for info in meta.output_info:
        if info.output_type == OutputType.alias_of_input:
            fetch_first.add(info.base_idx)
        elif info.output_type in (OutputType.alias_of_intermediate,
                                  OutputType.alias_of_intermediate_save_as_output):
            must_real.add(mutated + n_user + info.base_idx)
        elif info.output_type == OutputType.alias_of_intermediate_base_is_user_output:
            must_real.add(mutated + info.base_idx)
    return frozenset(must_real), frozenset(fetch_first)


def _compile_aten(gm: torch.fx.GraphModule, example_inputs, *, session, engine: str,
                  fallback: str, static: bool, kind: str = "inference", worker=None,
                  made: list | None = None, cuda_graphs: bool = False) -> RemoteGraph:
    """aot_autograd compiler hook: wrap one aten graph for remote execution."""
    from ..codec.graph import encode_graph

    def runner():
        if session is not None:
            return session
        if default_runner is None:
            raise RuntimeError("no default session: import remotorch (its root sets one)")
        return default_runner()

    from torch._subclasses.fake_tensor import unset_fake_temporarily

    payload, unsupported = None, None
    _placeholders_first(gm)
    try:
        with unset_fake_temporarily():  # constants are real tensors; read them outside fake mode
            payload = encode_graph(gm)
    except UnsupportedGraphError as exc:
        unsupported = exc
    devices = output_devices(gm)
    must_real, fetch_first = _aliased_outputs(kind, len(devices))
    graph = RemoteGraph(payload, runner=runner, engine=engine, fallback=fallback,
                        resident=_static_indices(example_inputs) if static else [],
                        output_devices=devices, local=None if device_only(gm) else gm.forward,
                        unsupported=unsupported,
                        kind=kind, saved_from=_saved_from() if kind == "forward" else None,
                        must_real=must_real, fetch_first=fetch_first, worker=worker,
                        layouts=_layouts(gm, kind), random=draws_random(gm), cuda_graphs=cuda_graphs)
    if made is not None:
        made.append((graph, kind == "inference" and _runs_direct(),
                     sum(1 for n in gm.graph.nodes if n.op == "placeholder")))
    return graph


def _layouts(gm: torch.fx.GraphModule, kind: str) -> Layouts | None:
    """The graph's output layouts as functions of its arguments (None: some cannot be known here).

    A backward graph's saved activations arrive as empty placeholders: its
    sizes are bound from its tangents and the sizes passed to it.
    """
    truthful = (lambda i, name: name.startswith("tangents")) if kind == "backward" else (lambda i, name: True)
    layouts = Layouts(gm, truthful)
    return layouts if layouts.known else None


def compile(fn, *, session=None, engine: str = "eager", fallback: str = "local", dynamic: bool | None = None,
            worker: int | str | None = None, custom_ops: str = "worker", cuda_graphs: bool = False):
    """``torch.compile`` with remotorch as the backend, with explicit control.

    ``engine`` is the worker-side engine (``"eager"``, ``"inductor"``);
    ``fallback`` is ``"local"`` (run locally with a warning on remote failure)
    or ``"raise"`` (raise the typed ``RemoteError``); ``dynamic=True`` makes
    one uploaded graph serve every batch size. ``worker`` picks which of the
    session's workers runs it (an index or a worker name; default the first):
    values one worker keeps move to another worker directly when its graphs
    take them.

    ``custom_ops``: ``"worker"`` (default) sends library custom operators by
    name, for a worker that allows their namespace (``remotorch serve
    --allow-ops``) to run; ``"decompose"`` first decomposes those that have a
    registered decomposition into aten operators, here
    (``benchmarks/custom_ops.py`` measures both).

    ``cuda_graphs=True``: a CUDA worker records each graph as a CUDA graph and
    replays it (``remotorch serve --cuda-graphs`` does for every graph); a graph
    it cannot record runs as usual, counted in its stats.
    """
    if fallback not in FALLBACKS:
        raise ValueError(f"fallback must be one of {FALLBACKS}, got {fallback!r}")
    if custom_ops not in CUSTOM_OPS:
        raise ValueError(f"custom_ops must be one of {CUSTOM_OPS}, got {custom_ops!r}")
    backend = functools.partial(remotorch_backend, session=session, engine=engine, fallback=fallback,
                                worker=worker, custom_ops=custom_ops, cuda_graphs=cuda_graphs)
    if isinstance(fn, torch.nn.Module):
        fn.register_state_dict_pre_hook(_RefreshBeforeStateDict(session))
    return torch.compile(fn, backend=backend, dynamic=dynamic)


class _RefreshBeforeStateDict:
    """``module.state_dict()`` gives the trained values: the parameters an optimizer stepped on a
    worker come back first (a read: it waits for the steps sent before it).

    A copy of the module (``copy.deepcopy``, ``torch.save`` of the whole module) keeps the hook but
    not the session: a session is a connection, not a value to copy.
    """

    def __init__(self, session) -> None:
        self.session = session

    def __call__(self, module: torch.nn.Module, prefix: str, keep_vars: bool) -> None:
        session = self.session  # None: the default session, if one is open (none: nothing ran remotely)
        runner = session if session is not None else (default_runner(create=False) if default_runner else None)
        refresh = getattr(runner, "refresh", None)
        if refresh is not None:
            refresh(module)

    def __deepcopy__(self, memo) -> _RefreshBeforeStateDict:
        return self

    def __reduce__(self):
        return (_RefreshBeforeStateDict, (None,))


_join_parts()  # the root's wiring (remotorch.client.wiring): dynamo may import this module alone, by entry point

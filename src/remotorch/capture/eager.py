"""One eager torch call on values a worker keeps, made a captured graph (``client.eager`` sends it).

Outside a compiled region, a torch call whose arguments include a value kept
on a worker (``client.remote.RemoteTensor``) runs on that worker. This
module turns such a call into a graph once per operator and argument layout
(dtypes, sizes, strides, ``requires_grad``, the other arguments' values), as
the dynamo backend turns a region into graphs, and the client calls it
directly, without dynamo: the same :class:`~remotorch.capture.graph.RemoteGraph`,
the same run path, the same queue, errors, randomness and moves between workers.

The call is traced once with fake tensors (``make_fx``), which gives its aten
graph and its result's layout, and says what kind of call it is:

* a call that writes into its arguments (``mul_``, ``x[i] = v``, ``out=``)
  stays as it is: the worker runs the graph on the kept values themselves,
  and the result is the arguments written into;
* a call whose result needs gradients is lowered by aot_autograd, as the
  backend does, into a forward and a backward graph: its result takes part
  in local autograd, and its backward runs on the worker;
* any other call is the traced graph itself (no functionalization to pay).

A call that reads values into Python (``item``, ``tolist``, a size that
depends on the data turned into a Python number), one whose result aliases
several arguments, or one fake tensors cannot run is :data:`LOCAL`: the
client reads its remote arguments and runs it here, as before. One that
touches no data (``register_hook``) is :data:`PLAIN`. A call that fake
tensors refuse is tried once on the stand-ins' own buffers (allocated, never
written): one torch refuses for its arguments' sizes or types (a shape
mismatch) raises torch's own error there, at once, before any element is read.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable

import torch
from torch.utils._pytree import tree_flatten

from ..client.eager import LOCAL, PLAIN, OpGraph, unflatten
from ..codec.rngstate import draws_random
from ..errors import UnsupportedGraphError
from .graph import RemoteGraph, output_devices
from .layout import Layouts

log = logging.getLogger(__name__)


class _NotRemote(Exception):
    """The call cannot run as a graph on the worker (see the module docstring)."""


def compile_op(func, leaves: list, shape, session, conn) -> OpGraph | object:
    """The call ``func`` with these arguments (``leaves`` flattened as ``shape`` says), as something
    ``client.eager`` can run: an :class:`OpGraph` on ``conn``'s worker, :data:`LOCAL` or :data:`PLAIN`.

    Raises torch's own error at once when torch refuses the call for its arguments' sizes or types.

    It holds dynamo's compile lock: make_fx keeps process-wide state (its current tracer, torch's
    pre-dispatch modes, FX's "tracing now" flag) that each trace saves and restores, so two traces in
    two threads at once (two eager calls, or one and a dynamo compile) could leave it set for good.
    """
    from torch._dynamo.convert_frame import compile_lock

    with compile_lock:
        return _compile_op(func, leaves, shape, session, conn)


def _compile_op(func, leaves: list, shape, session, conn) -> OpGraph | object:
    first: dict[int, int] = {}  # id(tensor) -> its position among the graph's inputs
    inputs: list[int] = []  # leaf index of each graph input
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and id(leaf) not in first:
            first[id(leaf)] = len(inputs)
            inputs.append(i)
    where = [first[id(leaf)] if isinstance(leaf, torch.Tensor) else -1 for leaf in leaves]
    seen: dict = {}
    try:
        gm, fakes, mode = _traced(func, leaves, shape, where, [leaves[i] for i in inputs], seen)
    except _NotRemote:
        return LOCAL
    except Exception as exc:  # noqa: BLE001 (torch's own refusal, or the fakes')
        if not _fake_only(exc):
            _refused_here(func, leaves, shape)  # raises torch's own error, as eager words it
        return LOCAL
    if not seen["ops"]:
        return PLAIN if not seen["mutated"] and not seen["fresh"] else LOCAL
    grad = torch.is_grad_enabled()
    needs_grad = grad and any(f.requires_grad for f in seen["fresh"])
    if seen["mutated"] and (needs_grad or (grad and any(fakes[j].requires_grad for j in seen["mutated"]))):
        return LOCAL  # writing into values that take part in autograd: read them and run it here
    name = _name(gm, func)
    try:
        run = (_lowered(gm, fakes, mode, session, conn, name) if needs_grad else
               _plain(gm, session, conn, name))
    except (UnsupportedGraphError, _NotRemote):
        return LOCAL
    except Exception:  # noqa: BLE001 (aot_autograd cannot lower it: read the values and run it here)
        log.debug("eager call %s runs here: aot_autograd could not lower it", name, exc_info=True)
        return LOCAL
    return OpGraph(run, inputs, seen["template"], seen["spec"], [inputs[j] for j in seen["mutated"]], name)


def _traced(func, leaves: list, shape, where: list[int], tensors: list, seen: dict):
    """The call's aten graph, traced on stand-ins of ``tensors``; and fake tensors of them (for
    aot_autograd) with their mode.

    Traced before dispatch (``pre_dispatch``), on fake tensors with a shape environment (a size
    that depends on the data is an unbacked size): an operator torch implements as a composite of
    others (``linalg.svdvals``, ``dropout``, ``softmax``) stays one call, which the worker runs as
    eager runs it (traced through, on fake tensors, which count as tensor subclasses,
    ``linalg.svdvals`` would compute singular vectors too and change its last bits). (Not on meta
    tensors: before dispatch, ``nll_loss`` on them gives the wrong size.) A call whose result needs
    gradients is traced as aot_autograd will lower it (through the composites), as a compiled
    region's is; so is one a worker could not resolve before dispatch.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv())
    with torch._C.DisableTorchFunctionSubclass(), mode:
        fakes = [_like(t, t.device) for t in tensors]
    tries = [(fakes, "fake", False)]  # (lowered as aot_autograd lowers)
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        tries.insert(0, (fakes, "fake", True))
    failure: Exception | None = None
    for stand_ins, tracing_mode, pre_dispatch in tries:
        try:
            gm = _trace(func, leaves, shape, where, stand_ins, seen, tracing_mode, pre_dispatch)
        except _NotRemote:
            raise
        except Exception as exc:  # noqa: BLE001 (refused before dispatch: the next way; else classified)
            failure = exc
            continue
        if _portable(gm):  # (before dispatch, torch may name an operator a worker never resolves: __or__)
            return gm, fakes, mode
    raise failure if failure is not None else _NotRemote("no graph a worker runs")


def _portable(gm: torch.fx.GraphModule) -> bool:
    """Whether every aten operator of the graph is one a worker resolves (protocol.md §12.2)."""
    from ..codec.ops import CORE_NAMESPACES, resolve_target, target_name

    try:
        for node in gm.graph.nodes:
            if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
                    and node.target.namespace in CORE_NAMESPACES:
                resolve_target(target_name(node.target))
    except UnsupportedGraphError:
        return False
    return True


def _like(t: torch.Tensor, device) -> torch.Tensor:
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
    return out.requires_grad_() if t.requires_grad else out


def _trace(func, leaves: list, shape, where: list[int], fakes: list, seen: dict,
           tracing_mode: str, pre_dispatch: bool) -> torch.fx.GraphModule:
    """``make_fx`` of the call on ``fakes``; fills ``seen`` with what the call did (see compile_op)."""
    from torch.fx.experimental import proxy_tensor
    from torch.fx.experimental.proxy_tensor import make_fx

    def fn(*ts):
        values = [ts[w] if w >= 0 else leaf for leaf, w in zip(leaves, where)]
        args, kwargs = unflatten(values, shape)
        before = [(t._version, tuple(t.shape), t.stride()) for t in ts]
        result = func(*args, **kwargs)
        after = [(t._version, tuple(t.shape), t.stride()) for t in ts]
        if any(b[1:] != a[1:] for b, a in zip(before, after)):
            raise _NotRemote("the call changes an argument's sizes or strides")
        seen["mutated"] = [j for j, (b, a) in enumerate(zip(before, after)) if b[0] != a[0]]
        outs, spec = tree_flatten(result)
        template, fresh = [], []
        for o in outs:
            if isinstance(o, torch.Tensor):
                same = next((j for j, t in enumerate(ts) if o is t), None)
                if same is not None:
                    template.append(("arg", same))
                    continue
                if any(torch._C._is_alias_of(o, t) for t in ts):
                    raise _NotRemote("the result views an argument")
                template.append(("out", len(fresh)))
                fresh.append(o)
            elif o is None or type(o) in (bool, int, float, str, torch.dtype, torch.device):
                template.append(("const", o))
            else:  # a Python number read from the data, an object: only here
                raise _NotRemote(f"the call returns a {type(o).__name__}")
        seen.update(template=template, spec=spec, fresh=fresh)
        return fresh

    tracer = proxy_tensor.PythonKeyTracer
    proxy_tensor.PythonKeyTracer = _quiet_tracer() or tracer  # (compile_op holds dynamo's compile lock: no
    try:  # other trace of remotorch's or dynamo's runs meanwhile)
        with torch._C.DisableTorchFunctionSubclass():
            gm = make_fx(fn, tracing_mode=tracing_mode, pre_dispatch=pre_dispatch)(*fakes)
    finally:
        proxy_tensor.PythonKeyTracer = tracer
    seen["ops"] = sum(1 for n in gm.graph.nodes if n.op == "call_function")
    return gm


_QUIET: list[type | None] = []


def _quiet_tracer() -> type | None:
    """make_fx's tracer, whose ``trace`` keeps FX's "tracing now" flag to itself.

    That flag is one global of ``torch.fx._symbolic_trace``, and dynamo reads
    it at every call of a compiled function: while it is set, a compiled call
    in any thread raises "using FX to symbolically trace a dynamo-optimized
    function" (pytorch#126024). An eager call is traced in the thread that
    makes it, the first time its kind is seen, so a program whose other
    threads call compiled models meanwhile would fail. This tracer runs FX's
    own ``Tracer.trace`` with a copy of that module's globals: the flag it sets
    and puts back is the copy's. (The call traced is one torch operator on fake
    tensors, with no compiled function in it: nothing here needs the flag.)
    """
    if not _QUIET:
        import inspect
        import types

        from torch.fx import _symbolic_trace
        from torch.fx.experimental import proxy_tensor

        trace = inspect.unwrap(_symbolic_trace.Tracer.trace)  # (dynamo wraps it, once imported, to stay out)
        if trace.__globals__ is not vars(_symbolic_trace):  # another torch's: FX's own tracer, flag and all
            log.warning("eager calls are traced with FX's own tracer: compiled calls in other threads "
                        "may raise while one is (pytorch#126024)")
            _QUIET.append(None)
            return None
        quiet = types.FunctionType(trace.__code__, dict(vars(_symbolic_trace)), trace.__name__, trace.__defaults__,
                                   trace.__closure__)
        quiet.__kwdefaults__, quiet.__qualname__ = trace.__kwdefaults__, trace.__qualname__
        quiet = torch._disable_dynamo(quiet)  # (as torch wraps FX's own)
        _QUIET.append(type("EagerCallTracer", (proxy_tensor.PythonKeyTracer,), {"trace": quiet}))
    return _QUIET[0]


def _fake_only(exc: BaseException) -> bool:
    """Whether fake tensors refused the call for a reason of their own (torch would run it)."""
    from torch._subclasses import fake_tensor

    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    kinds = (fake_tensor.DataDependentOutputException, fake_tensor.DynamicOutputShapeException,
             fake_tensor.UnsupportedOperatorException, fake_tensor.UnsupportedFakeTensorException,
             GuardOnDataDependentSymNode, NotImplementedError)
    return isinstance(exc, kinds) or not isinstance(exc, (RuntimeError, ValueError, TypeError, IndexError))


def _refused_here(func, leaves: list, shape) -> None:
    """Run the call here on the stand-ins' own buffers (allocated, never written): a call torch refuses
    for its arguments' sizes or types (what fake tensors refused) raises torch's own error, as eager
    words it, before it reads any element. One that reads an element into Python (a check on the
    values, a size from them) is stopped there, and one that runs was refused by the fakes alone:
    then the caller reads the values and runs it here."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class NoReads(TorchDispatchMode):
        def __torch_dispatch__(self, op, types, args=(), kwargs=None):
            tags = getattr(op, "tags", ())
            if torch.Tag.data_dependent_output in tags or torch.Tag.dynamic_output_shape in tags:
                raise _NotRemote("the call reads values")  # (garbage here: not the call's own refusal)
            return op(*args, **(kwargs or {}))

    args, kwargs = unflatten(list(leaves), shape)
    try:
        with torch._C.DisableTorchFunctionSubclass(), NoReads():
            func(*args, **kwargs)
    except _NotRemote:
        pass


def _name(gm: torch.fx.GraphModule, func) -> str:
    """The aten operator the call came to (its first), or the torch function's name."""
    for n in gm.graph.nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
            return str(n.target)
    return getattr(func, "__name__", str(func))


def _mark(graph: RemoteGraph, name: str) -> RemoteGraph:
    graph.eager_op = True  # client.policy / client.uploads: sent without waiting from its first call on
    graph.eager_outputs = [i for i, d in enumerate(graph.output_devices) if d is not None]  # (all stay there)
    graph.label = f"eager {name}" + (f" ({graph.kind})" if graph.kind != "inference" else "")
    return graph


def _plain(gm: torch.fx.GraphModule, session, conn, name: str) -> Callable:
    """The traced graph as one :class:`RemoteGraph` (no autograd), run on ``conn``'s worker."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from ..codec.graph import encode_graph

    with unset_fake_temporarily():
        payload = encode_graph(gm)  # (UnsupportedGraphError: LOCAL)
    layouts = Layouts(gm)
    runner = weakref.proxy(session)  # (the graph is kept with the connection: it must not keep the session)
    return _mark(RemoteGraph(payload, runner=lambda: runner, engine="eager", fallback="raise", resident=[],
                             output_devices=output_devices(gm), local=gm.forward, worker=conn,
                             layouts=layouts if layouts.known else None, random=draws_random(gm)), name)


def _lowered(gm: torch.fx.GraphModule, fakes: list, mode, session, conn, name: str) -> Callable:
    """The traced graph lowered by aot_autograd (forward and backward graphs, on ``conn``'s worker),
    as the dynamo backend lowers a region: its result takes part in local autograd."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._guards import TracingContext, tracing

    from . import backend

    runner = weakref.proxy(session)

    def make(gm, example_inputs, **kw):
        return _mark(backend._compile_aten(gm, example_inputs, session=runner, engine="eager",
                                           fallback="raise", worker=conn, **kw), name)

    with tracing(TracingContext(mode)), backend._effect_tokens_inside(), \
            backend.portable_attention(backend._worker_device(runner, conn)):
        compiled = aot_autograd(fw_compiler=functools.partial(make, static=True, kind="forward"),
                                inference_compiler=functools.partial(make, static=True),
                                bw_compiler=functools.partial(make, static=False, kind="backward"))(gm, fakes)

    def run(args: list) -> list:
        return list(compiled(*args))
    return run


def install() -> None:
    """Let ``client.eager`` compile calls (the package root calls this; client never imports capture)."""
    from ..client import eager

    eager.compile_op = compile_op

"""Call targets of graph documents: wire names, resolution through the allowlist, schema checks.

A target is named on the wire, never shipped: ``"aten::addmm.default"``,
``"op:getitem"``, or a library's custom operator
``"transformers::grouped_mm_fallback.default"``. The worker resolves a name
only

* through a fixed table of builtins,
* as an aten/prims operator overload (minus a denylist),
* as one of torch's own custom operators (namespace ``torch_nn``), or
* as a custom operator **already registered in its own process** (by a
  library its operator installed and allowed with ``remotorch serve
  --allow-ops NAMESPACE``), in an allowed namespace, with a schema that
  mutates nothing.

Every argument of a custom operator is then checked against its schema
(count, names, kinds: tensors vs scalars vs lists, dtypes where the schema
says ``ScalarType``) before the graph is built, so a document that does not
fit never reaches the library's kernel. Anything else is an
``UnsupportedGraphError`` naming the operator and the flag that would allow it.
"""

from __future__ import annotations

import importlib
import math
import operator
import re
from collections.abc import Iterable

import torch
import torch.fx

from ..errors import UnsupportedGraphError

# Builtins by wire name, each with its arity (``SEQ``: one list of operands). Besides
# ``getitem``, they are the symbolic-size arithmetic dynamo and aot_autograd emit on
# SymInt/SymFloat/SymBool values: the Python operators and math functions torch maps
# symbolic methods to (``torch.fx.experimental.sym_node.METHOD_TO_OPERATOR``),
# ``torch.sym_*`` and ``torch._sym_<fn>``. Every operand must be a scalar (a node
# producing one, or an int, float or bool), checked when a document is decoded.
SEQ = -1
SYMBOLIC: dict[str, tuple[object, int]] = {
    **{f"op:{n}": (getattr(operator, n), 2) for n in (
        "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "eq", "ne", "lt", "le", "gt", "ge",
        "and_", "or_", "xor", "lshift", "rshift")},
    **{f"op:{n}": (getattr(operator, n), 1) for n in ("neg", "pos", "abs", "not_", "invert")},
    **{f"math:{n}": (getattr(math, n), 1) for n in ("ceil", "floor", "trunc", "sqrt")},
    "builtin:round": (round, 1),  # (round(x, ndigits) is not symbolic arithmetic)
    "torch:sym_float": (torch.sym_float, 1), "torch:sym_int": (torch.sym_int, 1),
    "torch:sym_not": (torch.sym_not, 1), "torch:sym_max": (torch.sym_max, 2),
    "torch:sym_min": (torch.sym_min, 2), "torch:sym_ite": (torch.sym_ite, 3),
    "torch:sym_sum": (torch.sym_sum, SEQ),
    **{f"torch:_sym_{n}": (getattr(torch, f"_sym_{n}"), 1) for n in (
        "sqrt", "cos", "cosh", "sin", "sinh", "tan", "tanh", "asin", "acos", "atan", "log2")
       if hasattr(torch, f"_sym_{n}")},
}
# Higher-order operators that take an operator as an argument (what torch.utils.checkpoint
# lowers dropout and other random ops to, so that recomputation replays the same random
# numbers): the argument at this index names an operator, resolved as any call target is.
# ``with_effects(token, op, *args)`` runs an operator with a side effect (``aten._linalg_check_errors``,
# which raises on a singular matrix) in the order its effect tokens thread (torch/_higher_order_ops/
# effects.py); aot_autograd makes the tokens in the graph (``prims._make_token``) and sinks them
# (``prims._sink_tokens``), as it does for inductor. It gives ``(new token, *op's results)``.
OP_ARGUMENT: dict[str, int] = {"hop:run_and_save_rng_state": 0, "hop:run_with_rng_state": 1,
                               "hop:with_effects": 1}
# Higher-order operators whose arguments include subgraphs of the same document (torch.cond,
# while_loop, scan, map, flex_attention, nested_compile_region, and what aot_autograd lowers
# them to): their exact argument shapes are checked by codec/subgraphs.py.
SUBGRAPH_OPS: dict[str, object] = {f"hop:{n}": getattr(torch.ops.higher_order, n) for n in (
    "cond", "while_loop", "while_loop_stack_output", "scan", "map_impl", "flex_attention",
    "flex_attention_backward", "invoke_subgraph")}
BUILTINS: dict[str, object] = {
    "op:getitem": operator.getitem,
    **{name: fn for name, (fn, _) in SYMBOLIC.items()},
    "hop:run_and_save_rng_state": torch.ops.higher_order.run_and_save_rng_state,
    "hop:run_with_rng_state": torch.ops.higher_order.run_with_rng_state,
    "hop:with_effects": torch.ops.higher_order.with_effects,
    **SUBGRAPH_OPS,
}
_BUILTIN_NAMES = {id(fn): name for name, fn in BUILTINS.items()}
# Namespaces every worker resolves (with the denylist below); custom ones only when allowed.
CORE_NAMESPACES = frozenset({"aten", "prims"})
# torch's own custom operators (``torch.library.custom_op`` inside torch): every worker resolves
# them, checked against their schemas as any custom operator; each namespace with the module of
# torch that registers it on import (a fixed name here, never one from the wire).
TORCH_NAMESPACES: dict[str, str] = {"torch_nn": "torch.nn.modules.linear_cross_entropy"}
# Ops that reach outside the tensor world (files, process state) are refused
# even though they live in aten. (``aten::_assert_async``, what ``one_hot`` checks its
# classes with, is a plain check on a CPU; on an accelerator a failing one is a device-side
# assertion, which leaves the device unusable: worker/engines refuses it there.)
DENIED_OPS = frozenset({"aten::from_file", "aten::_print", "aten::set_",
                        "aten::save", "aten::_debug_has_internal_overlap"})
DEVICE_ASSERTS = frozenset({"aten::_assert_async", "aten::_functional_assert_async"})
IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
FLAG = "remotorch serve --allow-ops"


def target_name(target) -> str:
    """The wire name of a call target, or UnsupportedGraphError if no worker could resolve it.

    Operator overloads of any namespace get a name (whether a worker allows
    a custom namespace is the worker's decision, checked before upload);
    aten operators of the denylist, higher-order operators outside the
    builtins table and other Python callables do not.
    """
    if isinstance(target, torch._ops.OpOverload):
        ns, _, op = target._schema.name.partition("::")
        name = f"{ns}::{op}"
        if name not in DENIED_OPS and IDENT.match(ns) and IDENT.match(op):
            return f"{name}.{target._overloadname}"
    elif id(target) in _BUILTIN_NAMES:
        return _BUILTIN_NAMES[id(target)]
    raise UnsupportedGraphError(f"operation {getattr(target, '__name__', target)!s} cannot run remotely")


def namespace(name: str) -> str:
    """The namespace of an operator's wire name (``""`` for builtins)."""
    ns, sep, _ = name.partition("::")
    return ns if sep else ""


def custom_ops(names: Iterable[str]) -> tuple[str, ...]:
    """The wire names among ``names`` that are custom operators (namespace other than aten/prims and
    torch's own), sorted: those a worker must allow."""
    return tuple(sorted({n for n in names if namespace(n) not in ("", *CORE_NAMESPACES, *TORCH_NAMESPACES)}))


def refused(ops: Iterable[str], allowed: Iterable[str]) -> UnsupportedGraphError | None:
    """The error for the first operator whose namespace ``allowed`` lacks, or None when all are allowed."""
    allowed = frozenset(allowed)
    for name in ops:
        ns = namespace(name)
        if ns not in allowed:
            return not_allowed(name, ns)
    return None


def not_allowed(name: str, ns: str) -> UnsupportedGraphError:
    return UnsupportedGraphError(f"operation {name[:200]} cannot run remotely: the worker does not allow "
                                 f"custom operators of namespace {ns[:128]!r} (start it with "
                                 f"`{FLAG} {ns[:128]}`, or Session(allow_ops=[{ns[:128]!r}]) for the "
                                 f"embedded worker)")


def registered_namespaces() -> frozenset[str]:
    """Namespaces that have at least one operator registered in this process's dispatcher."""
    return frozenset(n.partition("::")[0] for n in torch._C._dispatch_get_all_op_names())


def resolve_target(name: str, allowed: frozenset[str] = frozenset()):
    """Map a wire name back to a callable: builtins table, aten/prims, or a registered custom op
    of an ``allowed`` namespace. Never imports, never walks an attribute path of the name."""
    if name in BUILTINS:
        return BUILTINS[name]
    qual, _, overload = name.rpartition(".")
    ns, sep, op = qual.partition("::")
    if not (sep and IDENT.match(ns) and IDENT.match(op) and IDENT.match(overload)
            and not op.startswith("__") and not overload.startswith("__")):
        raise UnsupportedGraphError(f"target {name[:200]!r} is not allowed")
    if ns not in CORE_NAMESPACES and ns not in allowed and ns not in TORCH_NAMESPACES:
        raise not_allowed(name, ns)
    if ns in TORCH_NAMESPACES:
        importlib.import_module(TORCH_NAMESPACES[ns])  # registers them (once; then a dict lookup)
    if f"{ns}::{op}" in DENIED_OPS:
        raise UnsupportedGraphError(f"operation {ns}::{op} is not allowed on a worker")
    if ns not in CORE_NAMESPACES and not _registered(f"{ns}::{op}", overload):
        raise UnsupportedGraphError(f"operation {name[:200]!r} does not exist on this worker "
                                    f"(no such operator is registered in namespace {ns!r})")
    try:
        overload_fn = getattr(getattr(getattr(torch.ops, ns), op), overload)
    except (AttributeError, RuntimeError):
        raise UnsupportedGraphError(f"operation {name[:200]!r} does not exist on this worker") from None
    if not isinstance(overload_fn, torch._ops.OpOverload):
        raise UnsupportedGraphError(f"target {name[:200]!r} is not an operator overload")
    if ns not in CORE_NAMESPACES and overload_fn._schema.is_mutable:
        raise UnsupportedGraphError(f"operation {name[:200]} mutates its arguments; custom operators that "
                                    f"write into their inputs are refused")
    return overload_fn


def _registered(qualified: str, overload: str) -> bool:
    """Whether the dispatcher has this operator overload registered (one lookup, no scan)."""
    try:
        torch._C._dispatch_find_schema_or_throw(qualified, "" if overload == "default" else overload)
    except RuntimeError:
        return False
    return True


# ------------------------------------------------------------ what values are
# The decoder knows what each node produces: "tensor", "scalar" (an int, float
# or bool, symbolic or not), "tensors" (a list of tensors), a tuple of those
# (an operator with several returns), or "unknown".
def output_kind(target):
    """What a call of ``target`` produces, from its schema (operators) or its nature (builtins)."""
    if not isinstance(target, torch._ops.OpOverload):
        return "unknown" if target is operator.getitem else "scalar"
    kinds = tuple(_type_kind(r.type) for r in target._schema.returns)
    return kinds[0] if len(kinds) == 1 else kinds


def _type_kind(t) -> str:
    if isinstance(t, torch._C.OptionalType):
        t = t.getElementType()
    if isinstance(t, torch._C.TensorType):
        return "tensor"
    if isinstance(t, torch._C.ListType) and isinstance(t.getElementType(), torch._C.TensorType):
        return "tensors"
    if isinstance(t, (torch._C.IntType, torch._C.SymIntType, torch._C.FloatType, torch._C.BoolType,
                      torch._C.NumberType)):
        return "scalar"
    return "unknown"


def getitem_kind(source_kind, index) -> str:
    """What ``source[index]`` is, given what ``source`` is."""
    if source_kind == "tensors":
        return "tensor"
    if isinstance(source_kind, tuple) and isinstance(index, int) and -len(source_kind) <= index < len(source_kind):
        return source_kind[index]
    return "unknown"


# ------------------------------------------------------------ schema checks
def check_call(op: torch._ops.OpOverload, args: tuple, kwargs: dict, kinds: dict) -> None:
    """Refuse a call whose arguments do not fit ``op``'s schema (before anything runs).

    ``kinds`` maps the graph's nodes to what they produce. Checked: the
    positional count, keyword names (no duplicates, none unknown), that every
    argument without a default is given, and each value's kind against its
    declared type.
    """
    schema = op._schema
    positional = [a for a in schema.arguments if not a.kwarg_only]
    if len(args) > len(positional):
        raise _mismatch(op, f"takes at most {len(positional)} positional arguments, the document gives {len(args)}")
    by_name = {a.name: a for a in schema.arguments}
    given = {a.name: v for a, v in zip(positional, args)}
    for key, value in kwargs.items():
        if key not in by_name or key in given:
            raise _mismatch(op, f"has no argument {key!r} left to give by keyword")
        given[key] = value
    for a in schema.arguments:
        if a.name not in given:
            if not a.has_default_value():
                raise _mismatch(op, f"argument {a.name!r} is missing")
            continue
        expected = getattr(a, "real_type", a.type)
        if not _fits(expected, given[a.name], kinds, 0):
            raise _mismatch(op, f"argument {a.name!r} must be {expected}, the document gives "
                                f"{_describe(given[a.name], kinds)}")


def _mismatch(op, what: str) -> UnsupportedGraphError:
    return UnsupportedGraphError(f"operation {target_name(op)} {what} (schema: {op._schema})")


def _fits(t, v, kinds: dict, depth: int) -> bool:
    if depth > 4:
        return False
    if isinstance(t, torch._C.OptionalType):
        return v is None or _fits(t.getElementType(), v, kinds, depth + 1)
    if isinstance(v, torch.fx.Node):
        kind = kinds.get(v, "unknown")
        if isinstance(t, torch._C.TensorType):
            return kind == "tensor"
        if isinstance(t, torch._C.ListType):
            return kind == "tensors" and isinstance(t.getElementType(), torch._C.TensorType)
        return kind == "scalar" and isinstance(t, _SCALAR_TYPES)
    if isinstance(t, torch._C.ListType):
        return isinstance(v, (list, tuple)) and all(_fits(t.getElementType(), x, kinds, depth + 1) for x in v)
    check = _LITERALS.get(type(t)) or _NAMED.get(str(t))
    return check is not None and check(v)


_SCALAR_TYPES = (torch._C.IntType, torch._C.SymIntType, torch._C.FloatType, torch._C.BoolType, torch._C.NumberType)
_LITERALS = {
    torch._C.IntType: lambda v: type(v) is int,
    torch._C.SymIntType: lambda v: type(v) is int,
    torch._C.FloatType: lambda v: type(v) in (int, float),
    torch._C.BoolType: lambda v: type(v) is bool,
    torch._C.NumberType: lambda v: type(v) in (int, float, bool, complex),
    torch._C.StringType: lambda v: type(v) is str,
    torch._C.DeviceObjType: lambda v: isinstance(v, torch.device),
}
# Types without a Python class of their own (``real_type`` of a schema argument), by name.
_NAMED = {
    "ScalarType": lambda v: isinstance(v, torch.dtype),
    "Layout": lambda v: isinstance(v, torch.layout),
    "MemoryFormat": lambda v: isinstance(v, torch.memory_format),
}


def _describe(v, kinds: dict) -> str:
    if isinstance(v, torch.fx.Node):
        return f"a node producing {kinds.get(v, 'unknown')}"
    return type(v).__name__


def check_builtin(name: str, args: tuple, kwargs: dict, kinds: dict) -> None:
    """Refuse a builtin call whose operands do not fit it (before anything runs).

    ``getitem`` takes a node and an int; symbolic arithmetic takes its arity
    of scalars (nodes producing one, or int, float and bool literals) and
    ``sym_sum`` one list of them, never keywords. So no builtin ever sees a
    tensor, a list to repeat or a string.
    """
    if kwargs:
        raise UnsupportedGraphError(f"operation {name} takes no keyword arguments")
    if name == "op:getitem":
        if len(args) != 2 or not isinstance(args[0], torch.fx.Node) or type(args[1]) is not int:
            raise UnsupportedGraphError("operation op:getitem takes a node and an int")
        return
    _, arity = SYMBOLIC[name]
    operands = args[0] if arity == SEQ and len(args) == 1 and isinstance(args[0], (list, tuple)) else args
    if (arity == SEQ and (len(args) != 1 or not operands)) or (arity != SEQ and len(args) != arity):
        want = "one list of scalars" if arity == SEQ else f"{arity} scalar operand(s)"
        raise UnsupportedGraphError(f"operation {name} takes {want}, the document gives {len(args)} argument(s)")
    for v in operands:
        if not (kinds.get(v) == "scalar" if isinstance(v, torch.fx.Node) else type(v) in (int, float, bool)):
            raise UnsupportedGraphError(f"operation {name} takes scalars, the document gives {_describe(v, kinds)}")

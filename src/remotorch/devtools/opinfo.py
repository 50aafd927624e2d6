"""torch's OpInfo database (``op_db``) run through remotorch and through ``aot_eager``, sample by sample.

torch ships, with its wheel, a sample-input generator for every operator it
tests (``torch.testing._internal.common_methods_invocations.op_db``; it needs
the ``expecttest`` package). Each sample becomes one small function, the
operator called on the sample's tensors (passed as arguments; everything
else fixed), compiled twice: with ``backend="aot_eager"`` and with remotorch
(``fallback="raise"``, against a real worker). A *case* is one sample of one
operator in one dtype and one direction:

* ``forward``: the outputs, compared;
* ``backward`` (operators that support autograd, in a dtype they
  differentiate): the outputs and the gradients of every input that requires
  one, for seeded random cotangents, compared.

Comparison is exact (``torch.testing.assert_close`` with tolerance 0, NaN
equal to NaN): both sides run the same aten graph with the same CPU kernels.
A case counts only when aot_eager runs it and, run twice (the second time
after freed memory of the outputs' sizes was overwritten, so that
uninitialized memory shows), gives the same values both times, and torch's
OpInfo does not mark the operator's output non-deterministic (random
operators, ``empty_like``); otherwise it is reported as *not counted*. A case
none of whose work reached a graph (dynamo ran it all eagerly: data-dependent
operators such as ``nonzero``) is also not counted: it says nothing about
remotorch. One where dynamo compiled a graph that never reached the worker
counts, as not equal.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree

from ..client.remote import fetch_all

logger = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int64": torch.int64,
                                  "bool": torch.bool, "complex64": torch.complex64}
DIRECTIONS = ("forward", "backward")
# What a case came to. Counted: EQUAL, DIFFERS, AS_COMPILED. Not counted: the rest.
EQUAL, DIFFERS = "equal", "differs"
# (the eager mode: differs from eager torch, equal to torch's own eager call behind the same compiled
# identity under aot_eager; remotorch.devtools.opinfo_eager)
AS_COMPILED = "as aot_eager"
REFERENCE_FAILS, NONDETERMINISTIC, NO_GRAPH = "aot_eager fails", "nondeterministic", "no graph"
STATUSES = (EQUAL, DIFFERS, AS_COMPILED, REFERENCE_FAILS, NONDETERMINISTIC, NO_GRAPH)
COUNTED = (EQUAL, DIFFERS, AS_COMPILED)
SEED = 0
# Operators a sweep found failing before a fix: the CI subset (tests/conformance/test_opinfo.py) runs
# them all, besides every k-th operator. (linalg.*: with_effects; linear_cross_entropy: torch_nn
# operators; chalf: complex32 on the wire; sgn: a ZeroTensor gradient on the wire; one_hot:
# aten._assert_async.)
FIXED = ("chalf", "linalg.cholesky", "linalg.eig", "linalg.eigvals", "linalg.inv", "linalg.ldl_factor",
         "linalg.lu_factor", "linalg.solve", "linalg.tensorinv", "linalg.tensorsolve",
         "nn.functional.linear_cross_entropy.chunked", "nn.functional.linear_cross_entropy.chunked_none",
         "nn.functional.one_hot", "sgn")


@dataclass(frozen=True)
class Case:
    """One sample of one operator, in one dtype and direction."""

    op: str  # the OpInfo's full name: ``name`` or ``name.variant``
    dtype: str
    direction: str
    index: int  # the sample's position among the operator's samples for this dtype

    def __str__(self) -> str:
        return f"{self.op} {self.dtype} {self.direction} #{self.index}"


@dataclass(frozen=True)
class Result:
    """What a case came to (one of :data:`STATUSES`) and, unless equal, why."""

    case: Case
    status: str
    detail: str = ""
    seconds: float = 0.0


# --------------------------------------------------------------------------- the database
def op_db() -> list:
    """The OpInfos torch ships, by full name, each once (import takes ~15 s; needs ``expecttest``)."""
    from torch.testing._internal.common_methods_invocations import op_db as database

    seen: dict[str, object] = {}
    for info in database:
        seen.setdefault(full_name(info), info)
    return [seen[name] for name in sorted(seen)]


def subset(infos: list, every: int) -> list:
    """Every ``every``-th of ``infos`` (in name order), the first included: a fixed choice."""
    return infos[::every]


def full_name(info) -> str:
    """``name`` or ``name.variant_test_name``: how the conformance run names an OpInfo."""
    return f"{info.name}.{info.variant_test_name}" if info.variant_test_name else info.name


def applies(info, dtype: str, direction: str) -> bool:
    """Whether ``info`` has samples for ``dtype`` in ``direction`` on CPU."""
    dt = DTYPES[dtype]
    if dt not in info.supported_dtypes("cpu"):
        return False
    if direction == "backward":
        return bool(info.supports_autograd) and dt in info.supported_backward_dtypes("cpu")
    return True


def marked_nondeterministic(info) -> bool:
    """Whether torch's OpInfo says the operator's output is non-deterministic (random operators,
    ``empty_like``…): it skips its CPU-against-device comparison with that reason."""
    for decorate in getattr(info, "decorators", ()):
        if getattr(decorate, "test_name", None) != "test_compare_cpu":
            continue
        for decorator in getattr(decorate, "decorators", ()):
            reasons = [_cell(c) for c in getattr(decorator, "__closure__", None) or ()]
            if "output is non-deterministic" in reasons:  # unittest.skip(reason) keeps it in a closure
                return True
    return False


def _cell(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def samples(info, dtype: str, direction: str, limit: int | None) -> list:
    """The first ``limit`` samples (all when None) of ``info`` for ``dtype`` (seeded: the same every run)."""
    torch.manual_seed(SEED)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        made = info.sample_inputs("cpu", DTYPES[dtype], requires_grad=direction == "backward")
        out = []
        for sample in made:
            if limit is not None and len(out) >= limit:
                break
            out.append(sample)
    return out


# --------------------------------------------------------------------------- one run of a sample
class _Call:
    """A sample as a function of its tensors: ``fn(*tensors)`` calls the operator, the rest fixed."""

    def __init__(self, info, sample, direction: str) -> None:
        self.info, self.sample, self.direction = info, sample, direction
        self.originals: list[torch.Tensor] = []
        # (input, args, kwargs) with each tensor replaced by its argument index (see _rebuild)
        self.template = _template((sample.input, sample.args, sample.kwargs), self.originals)

    def tensors(self) -> list[torch.Tensor]:
        """Fresh copies of the sample's tensors (an operator may write into its inputs)."""
        out = []
        for original in self.originals:
            t = original.detach().clone()
            out.append(t.requires_grad_(original.requires_grad) if t.is_floating_point() or t.is_complex() else t)
        return out

    def function(self) -> Callable:
        template, info = self.template, self.info
        process = self.sample.output_process_fn_grad if self.direction == "backward" else None

        def fn(*tensors):
            inp, args, kwargs = _rebuild(template, tensors)
            out = info.op(inp, *args, **kwargs)
            return process(out) if process is not None else out

        return fn

    def run(self, compiled: Callable) -> list:
        """Call ``compiled`` on fresh tensors: the output's leaves (and, backward, the gradients)."""
        tensors = self.tensors()
        out = compiled(*tensors)
        leaves = pytree.tree_leaves(out)
        if self.direction == "forward":
            return [_plain(v) for v in leaves]
        wanted = [t for t in tensors if t.requires_grad]
        outputs = [v for v in leaves if isinstance(v, torch.Tensor) and v.requires_grad]
        grads: tuple = ()
        if wanted and outputs:
            grads = torch.autograd.grad(outputs, wanted, _cotangents(outputs), allow_unused=True)
        return [_plain(v) for v in (*leaves, *grads)]


class _Arg:
    """Where a sample's tensor was: the index of the argument that stands for it."""

    def __init__(self, index: int) -> None:
        self.index = index


def _template(value, tensors: list):
    """``value`` with each tensor appended to ``tensors`` and replaced by an :class:`_Arg`."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return _Arg(len(tensors) - 1)
    if type(value) in (list, tuple):
        return type(value)(_template(v, tensors) for v in value)
    if type(value) is dict:
        return {k: _template(v, tensors) for k, v in value.items()}
    return value


def _rebuild(template, tensors: tuple):
    # plain containers only, so that dynamo traces this cheaply (pytree's unflatten costs more than the op)
    if isinstance(template, _Arg):
        return tensors[template.index]
    if type(template) is list:
        return [_rebuild(v, tensors) for v in template]
    if type(template) is tuple:
        return tuple(_rebuild(v, tensors) for v in template)
    if type(template) is dict:
        return {k: _rebuild(v, tensors) for k, v in template.items()}
    return template


def _cotangents(outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Seeded random cotangents, one per output: the same values for every run of a case."""
    g = torch.Generator().manual_seed(SEED)
    return [torch.randn(tuple(o.shape), dtype=o.dtype, generator=g) for o in outputs]


def _plain(v):
    """A value as a plain local tensor (read from a worker if it is remote) or as it is."""
    if not isinstance(v, torch.Tensor):
        return v
    fetch_all((v,))  # (as_subclass below reads the local buffer without asking: a kept value comes first)
    t = v.detach()
    if t._is_zerotensor():
        return torch.zeros(t.shape, dtype=t.dtype)
    return torch.Tensor.clone(t).as_subclass(torch.Tensor)


def _scribble(values: list) -> None:
    """Fill freed memory of the sizes of ``values`` with a pattern, so that an operator whose output
    is uninitialized memory (``empty_like``…) gives other values when run again, not the same
    reused block: such a case is then nondeterministic, as it is."""
    blocks = [torch.full((max(v.numel() * v.element_size(), 1),), 0xA5, dtype=torch.uint8)
              for v in values if isinstance(v, torch.Tensor) for _ in range(2)]
    del blocks


def difference(want: list, have: list) -> str | None:
    """Why ``have`` differs from ``want`` (None: the same, bit for bit, NaN equal to NaN)."""
    if len(want) != len(have):
        return f"{len(have)} values instead of {len(want)}"
    for i, (w, h) in enumerate(zip(want, have)):
        if isinstance(w, torch.Tensor) != isinstance(h, torch.Tensor):
            return f"value {i}: {type(h).__name__} instead of {type(w).__name__}"
        if isinstance(w, torch.Tensor):
            try:
                torch.testing.assert_close(h, w, rtol=0, atol=0, equal_nan=True, check_layout=False)
            except AssertionError as exc:
                return f"value {i}: " + " ".join(str(exc).split())[:240]
        elif not (w == h or (isinstance(w, float) and isinstance(h, float) and math.isnan(w) and math.isnan(h))):
            return f"value {i}: {h!r} instead of {w!r}"
    return None


def describe(exc: BaseException) -> str:
    """An error in one line: its type and the first line of its message (a backend's failure that
    dynamo wrapped: the backend's own error)."""
    inner = getattr(exc, "inner_exception", None)
    if isinstance(inner, BaseException):
        exc = inner
    text = [line for line in str(exc).strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


# --------------------------------------------------------------------------- one case
def check(info, sample, case: Case, session) -> Result:
    """Run one sample under aot_eager (twice) and remotorch; what it came to."""
    start = time.perf_counter()
    call = _Call(info, sample, case.direction)

    def result(status: str, detail: str = "") -> Result:
        return Result(case, status, detail, time.perf_counter() - start)

    if marked_nondeterministic(info):
        return result(NONDETERMINISTIC, "torch's OpInfo: output is non-deterministic")
    try:
        torch._dynamo.reset()
        reference = torch.compile(call.function(), backend="aot_eager")
        want = call.run(reference)
        _scribble(want)
        again = call.run(reference)
    except Exception as exc:  # torch's own backend fails: not counted
        return result(REFERENCE_FAILS, describe(exc))
    why = difference(want, again)
    if why is not None:
        return result(NONDETERMINISTIC, why)
    before, graphs = session.stats()["remote_calls"], _graphs()
    try:
        torch._dynamo.reset()
        compiled = torch.compile(call.function(), backend="remotorch",
                                 options={"session": session, "fallback": "raise"})
        have = call.run(compiled)
        session.synchronize()  # every request answered (a run nothing read is counted, or its failure raised)
    except Exception as exc:
        return result(DIFFERS, describe(exc))
    if session.stats()["remote_calls"] == before:
        why = difference(want, have)
        if _graphs() > graphs:
            return result(DIFFERS, f"dynamo compiled {_graphs() - graphs} graph(s), none ran on the worker"
                          + ("" if why is None else f"; {why}"))
        return result(NO_GRAPH, "" if why is None else f"(and differs: {why})")
    why = difference(want, have)
    return result(EQUAL) if why is None else result(DIFFERS, why)


def _graphs() -> int:
    """How many graphs dynamo has handed to a backend in this process."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def cases(infos: Iterable, dtypes: Iterable[str], directions: Iterable[str],
          limit: int | None) -> Iterator[tuple[object, object, Case]]:
    """(OpInfo, sample, case) for every applicable operator, dtype, direction and sample."""
    for info in infos:
        for dtype in dtypes:
            for direction in directions:
                if not applies(info, dtype, direction):
                    continue
                try:
                    made = samples(info, dtype, direction, limit)
                except Exception as exc:  # torch's own sample generator fails: nothing to run
                    logger.warning("no samples for %s %s %s: %s", full_name(info), dtype, direction, describe(exc))
                    continue
                for index, sample in enumerate(made):
                    yield info, sample, Case(full_name(info), dtype, direction, index)


def sweep(infos: Iterable, session, *, dtypes: Iterable[str] = tuple(DTYPES),
          directions: Iterable[str] = DIRECTIONS, limit: int | None = 2,
          progress: Callable[[Result], None] | None = None, checker: Callable | None = None) -> list[Result]:
    """Every case of ``infos`` (see :func:`cases`) checked on ``session``'s worker (by ``checker``:
    default :func:`check`; ``opinfo_eager.check`` for eager calls on kept values)."""
    results = []
    checker = checker or check
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for info, sample, case in cases(infos, list(dtypes), list(directions), limit):
            results.append(checker(info, sample, case, session))
            if progress is not None:
                progress(results[-1])
    return results


def tally(results: Iterable[Result]) -> dict[tuple[str, str], dict[str, int]]:
    """Counts of each status per (dtype, direction), plus ``counted`` (equal + differs) and ``ops``."""
    table: dict[tuple[str, str], dict[str, int]] = {}
    ops: dict[tuple[str, str], set] = {}
    for r in results:
        key = (r.case.dtype, r.case.direction)
        row = table.setdefault(key, dict.fromkeys((*STATUSES, "counted"), 0))
        row[r.status] += 1
        row["counted"] += r.status in COUNTED
        if r.status in COUNTED:
            ops.setdefault(key, set()).add(r.case.op)
    for key, row in table.items():
        row["ops"] = len(ops.get(key, ()))
    return table

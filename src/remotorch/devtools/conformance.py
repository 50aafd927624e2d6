"""Run the same user code under ``aot_eager`` and under remotorch, and compare what comes out.

A *case* is one model of the zoo (:mod:`remotorch.devtools.zoo`) in one
mode, written as a user writes it:

* ``forward``: ``model.eval()``, one call under ``torch.no_grad()``; every
  tensor of the output (logits, hidden states, the KV cache) is compared;
* ``generate``: ``model.forward`` compiled with ``dynamic=True``, then greedy
  ``generate`` with a KV cache on a left-padded batch, three new tokens,
  keeping each step's logits (a list of outputs read later); tokens and
  logits are compared;
* ``train``: two AdamW steps with ``labels=`` (the model computes its own
  loss) or, for models without labels, a loss computed here from the output;
  losses and every parameter afterwards are compared.

Under remotorch every case runs with ``fallback="raise"`` inside ``with
Session()``, with ``RemoteOptimizer`` for training, and its results are
read only after the block closed the session. The reference is the same
code under ``torch.compile(backend="aot_eager")`` with ``torch.optim.AdamW``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from .zoo import ModelSpec

MODES = ("forward", "generate", "train")
NEW_TOKENS = 3
LR = 1e-3
# float32 results of the same aten graph, run by the same kernels in two processes
RTOL, ATOL = 1e-4, 1e-5
PARAM_ATOL = 1e-4  # parameters after two AdamW steps (a tiny gradient's sign decides a whole step)


@dataclass
class Outcome:
    """What one case produced: named tensors, or the error that stopped it."""

    values: dict[str, torch.Tensor] = field(default_factory=dict)
    error: str | None = None
    fallbacks: int = 0
    seconds: float = 0.0
    remote_calls: int = 0  # graphs the worker ran (remotorch)

    @property
    def ok(self) -> bool:
        return self.error is None


def run_case(spec: ModelSpec, mode: str, backend: str,
             session: Callable[[], object] | None = None) -> Outcome:
    """Run ``spec`` in ``mode`` under ``backend`` (``"aot_eager"`` or ``"remotorch"``).

    For remotorch, ``session()`` makes the session (a context manager); the
    results are read after it closed.
    """
    if mode not in spec.modes:
        raise ValueError(f"{spec.name} has no {mode} mode")
    torch._dynamo.reset()
    _seed()
    start = time.perf_counter()
    outcome = Outcome()
    try:
        scope = session() if backend == "remotorch" else nullcontext()
        with scope as s:
            held = _MODES[mode](spec, _compiler(backend, s), _optimizer(backend, s))
        outcome.values = _read(held)  # after the session closed
        if s is not None:
            stats = s.stats()
            outcome.fallbacks, outcome.remote_calls = stats["fallbacks"], stats["remote_calls"]
    except Exception as exc:  # the case's failure is its result
        outcome.error = describe(exc)
    outcome.seconds = time.perf_counter() - start
    return outcome


def _seed(seed: int = 0) -> None:
    """Every random number source a model may draw from here (wav2vec2's masking uses numpy's)."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def compare(reference: Outcome, got: Outcome) -> str | None:
    """Why ``got`` differs from ``reference`` (None: it matches)."""
    if got.error:
        return got.error
    if got.fallbacks:
        return f"{got.fallbacks} graph(s) fell back to local execution"
    if reference.values.keys() != got.values.keys():
        missing = sorted(reference.values.keys() ^ got.values.keys())[:3]
        return f"different outputs: {missing}"
    for name, want in reference.values.items():
        have = got.values[name]
        if have.shape != want.shape or have.dtype != want.dtype:
            return f"{name}: {have.dtype}{list(have.shape)} instead of {want.dtype}{list(want.shape)}"
        if not want.is_floating_point() and not want.is_complex():
            if not torch.equal(have, want):
                return f"{name}: differs ({int((have != want).sum())} of {want.numel()} elements)"
            continue
        atol = PARAM_ATOL if name.startswith("param:") else ATOL
        if not torch.allclose(have, want, rtol=RTOL, atol=atol, equal_nan=True):
            diff = (have - want).abs().max().item()
            return f"{name}: max |difference| {diff:.3g}"
    return None


def describe(exc: BaseException) -> str:
    """An error in one line: its type and the first line of its message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


# --------------------------------------------------------------------------- the modes
def _compiler(backend: str, session) -> Callable:
    if backend == "aot_eager":
        return lambda fn, **kw: torch.compile(fn, backend="aot_eager", **kw)
    if backend == "remotorch":
        import remotorch

        return lambda fn, **kw: remotorch.compile(fn, session=session, fallback="raise", **kw)
    raise ValueError(f"unknown backend {backend!r}")


def _optimizer(backend: str, session) -> Callable:
    if backend == "remotorch":
        from ..optim import RemoteOptimizer

        return lambda params: RemoteOptimizer(torch.optim.AdamW, params, lr=LR, session=session)
    return lambda params: torch.optim.AdamW(params, lr=LR)


def _forward(spec: ModelSpec, compile_fn, make_optimizer) -> dict:
    model = spec.build().eval()
    compiled = compile_fn(model)
    with torch.no_grad():
        return {"out": compiled(**spec.inputs())}


def _generate(spec: ModelSpec, compile_fn, make_optimizer) -> dict:
    model = spec.build().eval()
    model.forward = compile_fn(model.forward, dynamic=True)
    out = model.generate(**spec.generate(spec.inputs()), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                         do_sample=False, return_dict_in_generate=True, output_logits=True)
    return {"tokens": out.sequences, "logits": list(out.logits)}


def _train(spec: ModelSpec, compile_fn, make_optimizer) -> dict:
    model = spec.build().train()
    compiled = compile_fn(model)
    optimizer = make_optimizer(model.parameters())
    inputs = spec.inputs()
    extra = spec.labels(inputs) if spec.labels else {}
    losses = []
    for _ in range(2):
        out = compiled(**inputs, **extra)
        loss = out.loss if spec.labels else synthetic_loss(out)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return {"loss": losses, **{f"param:{n}": p for n, p in model.named_parameters()}}


_MODES = {"forward": _forward, "generate": _generate, "train": _train}


def synthetic_loss(out) -> torch.Tensor:
    """For a model that takes no labels: the mean square of its first floating output."""
    first = next(t for t in _tensors(out, "") if t[1].is_floating_point())[1]
    return first.float().pow(2).mean()


# --------------------------------------------------------------------------- reading results
def _read(held: dict) -> dict[str, torch.Tensor]:
    """Every tensor held, by name, as plain local tensors (this is where remote values are read)."""
    out = {}
    for key, value in held.items():
        for name, t in _tensors(value, key):
            out[name] = torch.Tensor.clone(t.detach()).as_subclass(torch.Tensor)
    return out


def _tensors(value, name: str):
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, dict) or hasattr(value, "to_tuple"):  # dicts and transformers' ModelOutput
        for key in value.keys():
            yield from _tensors(value[key], f"{name}.{key}" if name else key)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _tensors(v, f"{name}.{i}")
    elif hasattr(value, "layers"):  # a transformers Cache: keys and values per layer
        for i, layer in enumerate(value.layers):
            for attr in ("keys", "values"):
                t = getattr(layer, attr, None)
                if isinstance(t, torch.Tensor):
                    yield f"{name}.{i}.{attr}", t
    elif hasattr(value, "sample") and isinstance(getattr(value, "sample"), torch.Tensor):  # diffusers outputs
        yield f"{name}.sample", value.sample


# --------------------------------------------------------------------------- references in a second process
def save_outcome(outcome: Outcome, path: str) -> None:
    """Write an outcome where :func:`load_outcome` reads it (atomically: a reader never sees half)."""
    import os

    tmp = f"{path}.tmp{os.getpid()}"
    torch.save({"values": outcome.values, "error": outcome.error, "fallbacks": outcome.fallbacks,
                "seconds": outcome.seconds}, tmp)
    os.replace(tmp, path)


def load_outcome(path: str) -> Outcome:
    """An outcome this process's own helper wrote (tensors and plain values only: weights_only)."""
    # client-side dev tool, never on the worker's receive path: a file this process's helper wrote,
    # read with weights_only=True (tensors and plain values; no pickled code runs)
    data = torch.load(path, weights_only=True)
    return Outcome(data["values"], data["error"], data["fallbacks"], data["seconds"])


def outcome_path(directory: str, name: str, mode: str) -> str:
    import os

    return os.path.join(directory, f"{name}.{mode}.pt")


class References:
    """aot_eager outcomes of a list of cases, computed by a second process while this one runs others.

    On two cores the reference runs and the remotorch runs overlap, which
    halves the time of the whole suite. The helper runs the cases in the
    order given; :meth:`get` waits for one.
    """

    def __init__(self, cases: list[tuple[str, str]], directory: str, timeout: float = 900.0) -> None:
        import subprocess
        import sys

        self.directory, self.timeout = directory, timeout
        self._log = open(f"{directory}/references.log", "w+b")
        self._proc = None
        if not cases:
            return
        args = [sys.executable, "-m", "remotorch.devtools.conformance", "--out", directory,
                *(f"{name}:{mode}" for name, mode in cases)]
        self._proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT)

    def get(self, name: str, mode: str) -> Outcome:
        import os

        path, deadline = outcome_path(self.directory, name, mode), time.monotonic() + self.timeout
        while not os.path.exists(path):
            if self._proc is None or (self._proc.poll() is not None and not os.path.exists(path)):
                self._log.seek(0)
                tail = self._log.read()[-3000:].decode(errors="replace")
                raise RuntimeError(f"the aot_eager reference process exited "
                                   f"without {name} {mode}:\n{tail}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no aot_eager reference for {name} {mode} after {self.timeout:.0f}s")
            time.sleep(0.05)
        return load_outcome(path)

    def close(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
        self._log.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m remotorch.devtools.conformance --out DIR MODEL:MODE…``: aot_eager outcomes into DIR."""
    import argparse

    from .zoo import by_name

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("cases", nargs="+", metavar="MODEL:MODE")
    args = parser.parse_args(argv)
    for case in args.cases:
        name, _, mode = case.partition(":")
        save_outcome(run_case(by_name(name), mode, "aot_eager"), outcome_path(args.out, name, mode))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

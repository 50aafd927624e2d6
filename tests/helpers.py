"""Plain helpers shared by the test files (the fixtures are in conftest.py).

Importable from every test folder as ``from helpers import ...``: pytest puts
``tests/`` on ``sys.path`` when it loads ``tests/conftest.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

import pytest
import torch

import remotorch

REPO = Path(__file__).resolve().parent.parent  # the repository's root (this file is tests/helpers.py)

# pytestmark of the files that need a CUDA device (select them with ``-m gpu``)
NEEDS_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


class Clock:
    """A clock the test moves by hand (``clock.now += 0.5``): time-dependent rules become exact."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def tiny_mlp(*sizes: int, act: type[torch.nn.Module] = torch.nn.ReLU, seed: int = 0) -> torch.nn.Sequential:
    """``Linear`` layers through ``sizes`` (``act`` between them), initialised after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [act(), torch.nn.Linear(a, b)] if layers else [torch.nn.Linear(a, b)]
    return torch.nn.Sequential(*layers)


def tiny_gpt2(seed: int = 0):
    """A 2-layer GPT-2 language model (vocabulary 128, width 32, no dropout), initialised after
    ``torch.manual_seed(seed)``: the training loop of the delay tests."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                     eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def token_batch(seed: int) -> torch.Tensor:
    """Two rows of 16 token ids for :func:`tiny_gpt2` (never 0, its end of text)."""
    return torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(seed))


class Probe:
    """``model`` in eval mode and its ``remotorch.compile`` on ``session`` (``fallback="raise"`` unless
    ``options`` say otherwise).

    ``probe(x)`` runs both without gradients, asserts that the compiled answer is torch's own to the bit,
    and returns it. ``x`` defaults to the input given here: a tensor, or a function that makes a fresh
    one for each call.
    """

    def __init__(self, session, model: torch.nn.Module, x: torch.Tensor | Callable[[], torch.Tensor] | None = None,
                 **options) -> None:
        self.model = model.eval()
        self.x = x
        self.compiled = remotorch.compile(self.model, session=session, **{"fallback": "raise", **options})

    def __call__(self, x: torch.Tensor | None = None) -> torch.Tensor:
        if x is None:
            x = self.x() if callable(self.x) else self.x
        with torch.no_grad():
            out = self.compiled(x)
            assert torch.equal(out, self.model(x))
        return out


def assert_still_serves(session, *, name: str = "test", probe: Probe | None = None, server=None) -> None:
    """The worker behind ``session`` kept serving after something bad was sent to it.

    A compiled model gives torch's exact answer (``probe``, compiled on the worker before the bad
    thing, or else a new small one on ``session``), the worker's health names it ``name``, and
    ``server`` (its process, where given) is alive.
    """
    if probe is None:
        torch._dynamo.reset()
        probe = Probe(session, tiny_mlp(6, 8, 2), torch.randn(3, 6))
    probe()
    assert session.health()["name"] == name
    if server is not None:
        assert server.alive(), server.stderr_text()[-4000:]


def train_steps(loss_of: Callable[[], torch.Tensor], opt, steps: int = 2,
                after_step: Callable[[], object] | None = None) -> list[torch.Tensor]:
    """``steps`` training steps: ``loss_of()`` backward, ``opt.step()``, ``opt.zero_grad()``, then
    ``after_step()`` (e.g. lr schedulers). The losses, detached."""
    losses = []
    for _ in range(steps):
        loss = loss_of()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if after_step is not None:
            after_step()
        losses.append(loss.detach())
    return losses


def assert_a_value_moves_worker_to_worker(session, first, second) -> None:
    """A 1 MiB result kept on worker ``first`` is taken by a graph on ``second``: it moves between the two
    workers (the client sends and receives well under 64 KiB), is never fetched here, the copy on
    ``second`` serves a second call too, and every result equals eager."""
    produce = remotorch.compile(lambda a: torch.sin(a) * 2, session=session, worker=first, fallback="raise")
    consume = remotorch.compile(lambda v: v.cos() + 1, session=session, worker=second, fallback="raise")
    x = torch.randn(512, 512)  # 1 MiB
    with torch.no_grad():
        y = produce(x)
        assert y.is_remote
        before = session.stats()
        z = consume(y)
        after = session.stats()
        through_client = (after["bytes_sent"] - before["bytes_sent"]) + \
            (after["bytes_received"] - before["bytes_received"])
        assert after["values_moved"] == before["values_moved"] + 1
        assert through_client < 64 << 10, through_client  # y went from worker to worker
        assert y.is_remote  # and it was never fetched here
        torch.testing.assert_close(z, (torch.sin(x) * 2).cos() + 1)
        again = consume(y)  # the copy on the second worker is used again
        assert session.stats()["values_moved"] == before["values_moved"] + 1
        torch.testing.assert_close(again, z)
    assert session.stats()["fallbacks"] == 0


def assert_data_parallel_trains_as_one_process(session, model: torch.nn.Module, x, y, steps: int = 3):
    """``DataParallel(model)`` on ``session`` against one local process training a copy on the whole
    batch with AdamW: every step's loss and the pulled parameters equal (1e-4). Returns the
    DataParallel and what its ``pull`` returned."""
    import copy

    from torch.nn import functional as F

    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    dp = remotorch.parallel.DataParallel(model, session=session, loss_fn=F.mse_loss)
    opt = dp.optimizer(torch.optim.AdamW, lr=1e-2)
    for _ in range(steps):
        expected = F.mse_loss(ref(x), y)
        expected.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        got = dp.step(x, y)
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(got, expected.detach(), rtol=1e-4, atol=1e-4)
    pulled = dp.pull()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-4)
    return dp, pulled


class Lines:
    """A child process's output stream, read line by line on a thread (nothing blocks on a full pipe),
    so that a test acts on a sign the child gives (a line it prints), never after a fixed sleep."""

    def __init__(self, stream: IO[str]) -> None:
        self._lines: list[str] = []
        self._changed = threading.Condition()
        self._done = False
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            with self._changed:
                self._lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self._done = True
            self._changed.notify_all()

    def wait_for(self, sign: Callable[[str], bool], timeout: float = 120.0) -> str:
        """The first line for which ``sign(line)`` holds, once it is there (``AssertionError`` with all
        that was read, if the stream ends or ``timeout`` passes first)."""
        deadline = time.monotonic() + timeout
        seen = 0
        with self._changed:
            while True:
                for line in self._lines[seen:]:
                    if sign(line):
                        return line
                seen = len(self._lines)
                left = deadline - time.monotonic()
                if self._done or left <= 0:
                    raise AssertionError("the sign never came; the stream said:\n" + "".join(self._lines)[-4000:])
                self._changed.wait(left)

    def text(self, timeout: float = 60.0) -> str:
        """Everything the stream said, once it ended (the child exited)."""
        self._thread.join(timeout)
        with self._changed:
            return "".join(self._lines)


def default_ctrl_c() -> None:
    """A child's ``preexec_fn``: Ctrl-C as at a terminal. A run started in the background (``cmd &`` in a
    script) ignores SIGINT, and so would every process it starts, Python's handler included."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)

"""Lightning's ``Trainer.fit`` on a LightningModule whose submodule is compiled with ``backend="remotorch"``.

Lightning owns the loop (its optimizer closure runs the step and the backward
inside ``optimizer.step``); remotorch runs the compiled submodule's forward
and backward graphs on a real worker. It must train exactly as the same run
compiled with ``aot_eager`` does: the same losses, step by step, and the
same weights after. Nothing is written: no logger, no checkpoints, no
progress bar, and the Trainer's root folder stays empty.

The module compiles with ``torch.compile(body, backend="remotorch")`` and no
options, so its graphs run on the default session (here the test server's
session), or with ``options={"session": s}``. Importing Lightning wraps
``torch.compile`` to deep-copy its keyword arguments whenever it compiles a
module: a deep copy of a ``Session`` is the session itself (a connection, not
a value), so the graphs run on ``s``. Lightning is imported by a fixture, not
when this file is collected, and ``torch.compile`` is given back afterwards,
so the rest of the run compiles without the wrapper.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remotorch.client.session

STEPS = 4


@pytest.fixture
def L():
    """Lightning, with ``torch.compile`` as importing it leaves it, for this test only (torch's own after)."""
    own = _unwrapped(torch.compile)
    import lightning  # part of the test extra: a missing one fails here rather than skipping
    from lightning.fabric.wrappers import _capture_compile_kwargs

    torch.compile = _capture_compile_kwargs(own)  # what the first import of Lightning in a process does
    try:
        yield lightning
    finally:
        torch.compile = own


def _lightnings(fn) -> bool:
    """Whether ``fn`` is Lightning's wrapper of ``torch.compile`` (functools.wraps gives it torch's names)."""
    code = getattr(fn, "__code__", None)
    return hasattr(fn, "__wrapped__") and code is not None and "lightning" in code.co_filename


def _unwrapped(fn):
    return fn.__wrapped__ if _lightnings(fn) else fn


@pytest.fixture
def default_session(session, monkeypatch):
    """The test server's session as the one ``backend="remotorch"`` runs on when given none."""
    monkeypatch.setattr(remotorch.client.session, "_default", session)
    return session


def _fit(L, backend: str, root, options: dict | None = None) -> tuple[list[float], dict]:
    class Regressor(L.LightningModule):
        """A small regression model; ``body`` is the compiled submodule."""

        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
            self.body = torch.compile(body, backend=backend, options=options)
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.body(x), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.05)

    data = torch.utils.data.TensorDataset(torch.randn(16, 8, generator=torch.Generator().manual_seed(1)),
                                          torch.randn(16, 1, generator=torch.Generator().manual_seed(2)))
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=False)
    module = Regressor()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)
    trainer.fit(module, loader)
    return module.losses, {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_lightning_fit_with_a_compiled_submodule_trains_as_aot_eager(L, default_session, tmp_path):
    session = default_session
    want_losses, want = _fit(L, "aot_eager", tmp_path)
    calls_before = session.stats()["remote_calls"]
    got_losses, got = _fit(L, "remotorch", tmp_path)
    assert len(got_losses) == STEPS and len(set(got_losses)) == STEPS, got_losses  # it trained: every loss differs
    torch.testing.assert_close(got_losses, want_losses)
    torch.testing.assert_close(got, want)
    assert session.stats()["remote_calls"] - calls_before >= 2 * STEPS  # a forward and a backward per step
    assert session.stats()["fallbacks"] == 0
    assert not list(tmp_path.iterdir())  # no logs, no checkpoints


def test_a_session_in_compile_options_survives_lightnings_deepcopy_and_runs_the_graphs(L, session, tmp_path):
    """Lightning deep-copies ``torch.compile``'s keyword arguments: the session in ``options`` stays the
    session (its deep copy is itself), and the graphs run there, equal to aot_eager."""
    assert _lightnings(torch.compile)
    assert remotorch.client.session._default is None or remotorch.client.session._default is not session
    want_losses, want = _fit(L, "aot_eager", tmp_path)
    calls_before = session.stats()["remote_calls"]
    got_losses, got = _fit(L, "remotorch", tmp_path, options={"session": session})
    torch.testing.assert_close(got_losses, want_losses)
    torch.testing.assert_close(got, want)
    assert session.stats()["remote_calls"] - calls_before >= 2 * STEPS


def test_torch_compile_is_torchs_own_after_the_lightning_tests():
    """Runs after the tests above: the rest of the run compiles without Lightning's wrapper."""
    assert not _lightnings(torch.compile)

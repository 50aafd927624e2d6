"""remotorch workers on Modal GPUs: ``with remotorch.deploy.modal.worker(gpu="H100") as session:``.

The pattern users want on Modal (one long-lived GPU container, tensor work
there, data and files here) with remotorch's own protocol instead of pickled
calls:

* :func:`make_app` builds the ``modal.App``: an image with this machine's
  torch version and remotorch's own source, and one function
  (:func:`remotorch.deploy.container.serve_in_container`) on the chosen GPU
  with the chosen timeout. Building it needs no Modal account, so it is
  inspectable and tested offline.
* :func:`launch` runs the app (``app.run()``: an ephemeral app whose
  containers stop when the block ends), spawns the function with a random
  token, and waits for the container's answer: a ``tls://`` address behind a
  Modal TCP tunnel and the worker's self-signed certificate, which the
  client then trusts alone (TLS end to end; Modal's relay sees ciphertext).
* :func:`worker` is :func:`launch` plus a :class:`~remotorch.Session` to the
  worker, closed before the container stops.

With ``volume="NAME"`` (``--volume NAME``) the worker keeps its disk cache
(``remotorch serve --cache-dir``) on the ``modal.Volume`` NAME, mounted at
:data:`CACHE_MOUNT` and created on first use: a second run of the same script
starts warm, since the weights, graphs and compiled artifacts the first run
left are on the Volume and the client proves it holds them instead of
uploading them again. Without a Volume the container runs with no disk cache.

``remotorch deploy modal --gpu A100`` is the same from the command line.
Needs ``pip install remotorch[modal]`` and Modal credentials (``modal
setup``); without them :func:`launch` raises
:class:`~remotorch.errors.WorkerUnavailableError` saying so.
"""

from __future__ import annotations

import logging
import queue
import re
import secrets
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from .. import errors
from ..client.session import Session
from .container import serve_in_container

log = logging.getLogger(__name__)

#: $ per hour of one GPU of each type, from Modal's published price list (modal.com/pricing, 2025):
#: the default ``price_per_hour`` a Modal worker reports to the profiler. Check the page; pass your own.
MODAL_PRICES = {"T4": 0.59, "L4": 0.80, "A10G": 1.10, "L40S": 1.95, "A100": 2.10, "A100-40GB": 2.10,
                "A100-80GB": 2.50, "H100": 3.95, "H200": 4.54, "B200": 6.25}

# what the image installs besides torch: remotorch's own dependencies (pyproject.toml), at the versions
# this machine runs (the wire format is theirs too)
_PINNED = ("msgspec", "numpy", "cryptography", "rich")
_ENGINE_PACKAGES = ("onnx", "onnxscript")

#: where a Modal worker's Volume is mounted in its container: the worker's ``--cache-dir``
CACHE_MOUNT = "/cache"
_VOLUME_NAME = re.compile(r"[A-Za-z0-9._-]{1,63}")  # Modal's rule for object names (modal/_utils/name_utils.py)


@dataclass(frozen=True)
class ModalWorker:
    """What to deploy: GPU type (``"H100"``, ``"A100:2"``…, None for a CPU container), lifetime, names.

    ``timeout`` (seconds) is the container's lifetime: Modal stops it then.
    ``price_per_hour`` defaults to :data:`MODAL_PRICES` for the GPU (times
    the count), else 0. ``volume`` names a ``modal.Volume`` (created if
    missing) that holds the worker's disk cache at :data:`CACHE_MOUNT`, so
    the next run with the same Volume starts warm; None: no disk cache.
    """

    gpu: str | None = "H100"
    timeout: int = 3600
    name: str = "modal"
    app_name: str = "remotorch"
    port: int = 7878
    price_per_hour: float | None = None
    engines: tuple[str, ...] | None = None
    python: str = field(default_factory=lambda: f"{sys.version_info.major}.{sys.version_info.minor}")
    start_timeout: float = 900.0  # image build and container start included
    volume: str | None = None

    def __post_init__(self) -> None:
        if not 10 <= self.timeout <= 24 * 3600:
            raise ValueError(f"timeout must be 10 s to 24 h (Modal's limit), got {self.timeout}")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"port must be 1-65535, got {self.port}")
        if self.volume is not None and not _VOLUME_NAME.fullmatch(self.volume):
            raise ValueError(f"volume must be a Modal name (letters, digits, '-', '_', '.'; under 64 characters), "
                             f"got {self.volume!r}")

    @property
    def price(self) -> float:
        """$ per hour reported to profiles: the given price, else Modal's list price for the GPU."""
        if self.price_per_hour is not None:
            return self.price_per_hour
        if not self.gpu:
            return 0.0
        kind, _, count = self.gpu.upper().partition(":")
        return MODAL_PRICES.get(kind, 0.0) * (int(count) if count.isdigit() else 1)

    def packages(self) -> list[str]:
        """pip requirements of the image: this machine's torch and wire libraries, ONNX for the onnxrt engine."""
        import torch

        pins = [f"torch=={torch.__version__.split('+')[0]}"]
        pins += [f"{p}=={metadata.version(p)}" for p in _PINNED]
        return pins + [*_ENGINE_PACKAGES, "onnxruntime-gpu" if self.gpu else "onnxruntime"]


def _modal():
    try:
        import modal
    except ImportError:
        raise ImportError("Modal workers need the modal package: pip install 'remotorch[modal]'") from None
    return modal


def _build(spec: ModalWorker):
    """The App and its one function (kept apart: ``App.registered_functions`` is deprecated).

    With ``spec.volume`` the function mounts that Volume at :data:`CACHE_MOUNT`
    (``Volume.from_name(..., create_if_missing=True)``: a lazy handle, so
    building still contacts nobody).
    """
    modal = _modal()
    image = (modal.Image.debian_slim(python_version=spec.python)
             .pip_install(*spec.packages())
             .add_local_python_source("remotorch"))  # the same remotorch source as this client
    app = modal.App(spec.app_name, image=image)
    volumes = {CACHE_MOUNT: modal.Volume.from_name(spec.volume, create_if_missing=True)} if spec.volume else {}
    fn = app.function(gpu=spec.gpu, timeout=spec.timeout, max_containers=1, serialized=False,
                      volumes=volumes)(serve_in_container)
    return app, fn


def make_app(gpu: str | None = "H100", *, timeout: int = 3600, name: str = "modal", app_name: str = "remotorch",
             port: int = 7878, price_per_hour: float | None = None, volume: str | None = None):
    """The ``modal.App`` that runs a remotorch worker on ``gpu`` for up to ``timeout`` seconds.

    Its one function is :func:`remotorch.deploy.container.serve_in_container`.
    ``volume`` names the ``modal.Volume`` mounted at :data:`CACHE_MOUNT` for
    the worker's disk cache (see :class:`ModalWorker`); its function then
    needs ``cache_dir=CACHE_MOUNT, volume=volume`` in its call, as
    :func:`launch` passes them. Nothing is contacted: run it with
    ``app.run()`` (what :func:`launch` does) or ``modal deploy``.
    """
    return _build(ModalWorker(gpu=gpu, timeout=timeout, name=name, app_name=app_name, port=port,
                              price_per_hour=price_per_hour, volume=volume))[0]


@dataclass(frozen=True)
class Deployment:
    """A worker running on Modal: how to reach it, and until when."""

    url: str
    token: str
    tls_ca: str  # path of the worker's certificate (PEM): trust exactly this one
    name: str
    gpu: str | None
    expires_at: float  # time.time() when Modal stops the container

    def session(self, **options) -> Session:
        """A :class:`~remotorch.Session` to this worker (certificate pinned)."""
        return Session(self.url, token=self.token, tls_ca=self.tls_ca, **options)


def credentials_configured() -> bool:
    """Whether Modal has credentials here (``modal setup``, or MODAL_TOKEN_ID and MODAL_TOKEN_SECRET)."""
    try:
        from modal.config import config
    except ImportError:
        return False
    return bool(config.get("token_id") and config.get("token_secret"))


@contextmanager
def launch(spec: ModalWorker, *, show_output: bool = False) -> Iterator[Deployment]:
    """Start a worker on Modal for ``spec`` and yield its :class:`Deployment`; stop it when the block ends.

    ``show_output`` shows Modal's image build and container logs. With
    ``spec.volume`` the worker's disk cache is that Volume (mounted at
    :data:`CACHE_MOUNT`), so what an earlier run uploaded or compiled is
    there already.
    Raises :class:`~remotorch.errors.WorkerUnavailableError` when Modal
    refuses (no credentials) or the worker does not come up within
    ``spec.start_timeout``.
    """
    modal = _modal()
    app, fn = _build(spec)
    token = secrets.token_urlsafe(32)
    with ExitStack() as stack:
        if show_output:
            stack.enter_context(modal.enable_output())
        try:
            stack.enter_context(app.run())
        except modal.exception.AuthError as exc:
            raise errors.WorkerUnavailableError(
                "Modal has no valid credentials here: run `modal setup` (or set MODAL_TOKEN_ID and "
                f"MODAL_TOKEN_SECRET) first ({exc})") from None
        started = time.time()
        reply = stack.enter_context(modal.Queue.ephemeral())
        cache = dict(cache_dir=CACHE_MOUNT, volume=spec.volume) if spec.volume else {}
        call = fn.spawn(token, reply, port=spec.port, name=spec.name, price_per_hour=spec.price,
                        engines=list(spec.engines) if spec.engines else None, **cache)
        stack.callback(_cancel, call)
        info = _await_ready(reply, call, spec.start_timeout)
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="remotorch-modal-")))
        ca = folder / "worker.pem"
        ca.write_text(info["cert"])
        yield Deployment(info["url"], token, str(ca), spec.name, spec.gpu, started + spec.timeout)


@contextmanager
def worker(gpu: str | None = "H100", *, volume: str | None = None, timeout: int = 3600, name: str = "modal",
           price_per_hour: float | None = None, show_output: bool = False, **session_options) -> Iterator[Session]:
    """A :class:`~remotorch.Session` to a fresh remotorch worker on a Modal ``gpu``.

    ``with remotorch.deploy.modal.worker(gpu="H100") as session:`` then
    ``remotorch.compile(model, session=session)``; the session closes and
    the container stops when the block ends (or after ``timeout`` seconds).
    ``volume="NAME"`` keeps the worker's disk cache on that ``modal.Volume``
    (created if missing): the second run of the same script starts warm,
    its weights, graphs and compiled artifacts already on the Volume.
    ``session_options`` go to :class:`~remotorch.Session`.
    """
    spec = ModalWorker(gpu=gpu, timeout=timeout, name=name, price_per_hour=price_per_hour, volume=volume)
    with launch(spec, show_output=show_output) as deployment, deployment.session(**session_options) as session:
        yield session


def _await_ready(reply, call, timeout: float) -> dict:
    """The container's ``{"url", "cert"}``; raises if the call ends or the time runs out first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            info = reply.get(timeout=min(5.0, max(0.1, deadline - time.monotonic())))
        except queue.Empty:
            info = None
        if info is not None:
            if not (isinstance(info, dict) and str(info.get("url", "")).startswith("tls://")
                    and isinstance(info.get("cert"), str)):
                raise errors.ProtocolError(f"the Modal container answered {type(info).__name__}, not an address")
            return info
        try:
            call.get(timeout=0)
        except TimeoutError:
            continue  # still starting
        except Exception as exc:
            raise errors.WorkerUnavailableError(f"the Modal container failed before serving: {exc}") from exc
        raise errors.WorkerUnavailableError("the Modal container ended before serving")
    raise errors.WorkerUnavailableError(f"no remotorch worker on Modal within {timeout:.0f}s")


def _cancel(call) -> None:
    try:
        call.cancel(terminate_containers=True)
    except Exception as exc:  # the app's end stops the container anyway
        log.debug("cancelling the Modal call failed: %s", exc)

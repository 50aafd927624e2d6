"""Shared fixtures: a real ``remotorch serve`` subprocess on loopback, and sessions to it.

Rule 3 of the design: integration tests talk to a real worker server over the
real transport. The session-scoped ``server`` fixture starts one for the whole
run; ``start_server`` starts extra ones for tests that kill or misuse a server.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass

import pytest
import torch

import remotorch
from remotorch.client.embedded import spawn_worker
from remotorch.errors import WorkerUnavailableError

TOKEN = "test-token-0123456789"
START_TIMEOUT = 120.0


@dataclass
class ServerProcess:
    """A running ``remotorch serve`` child process and where it listens."""

    proc: subprocess.Popen
    url: str
    token: str | None
    name: str
    stderr_path: str

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @property
    def host(self) -> str:
        return self.url.split("://", 1)[1].rsplit(":", 1)[0]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stderr_text(self) -> str:
        try:
            with open(self.stderr_path, encoding="utf-8", errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def stop(self) -> None:
        """Kill the server (idempotent) and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # pragma: no cover - kill does not fail on Linux
            pass
        try:
            os.unlink(self.stderr_path)
        except OSError:
            pass


def clean_env(**extra: str) -> dict:
    """The current environment without REMOTORCH_* settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("REMOTORCH_")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def spawn_server(*, token: str | None = TOKEN, name: str = "test", extra_args: tuple = (),
                 env: dict | None = None) -> ServerProcess:
    """Start ``python -m remotorch serve`` on a free loopback port and wait until it serves.

    ``env``: variables added to its (otherwise clean) environment, e.g. ``PYTHONPATH``.
    """
    args = ["--host", "127.0.0.1", "--port", "0", "--name", name, *extra_args]
    if SUITE_CACHE and "--cache-dir" not in args and "--no-cache" not in args:
        args += ["--cache-dir", SUITE_CACHE]
    if token is not None:
        args += ["--token", token]
    fd, stderr_path = tempfile.mkstemp(prefix="remotorch-server-", suffix=".log")
    try:
        with os.fdopen(fd, "w") as stderr:
            worker = spawn_worker(args, env=clean_env(**(env or {})), stderr=stderr, start_timeout=START_TIMEOUT)
    except WorkerUnavailableError as exc:
        with open(stderr_path, encoding="utf-8", errors="replace") as f:
            log = f.read()
        os.unlink(stderr_path)
        raise RuntimeError(f"remotorch serve did not start ({exc}):\n{log}") from None
    assert worker.url.startswith(("tcp://127.0.0.1:", "tls://127.0.0.1:", "unix:///")), worker.url
    return ServerProcess(worker.proc, worker.url, token, name, stderr_path)


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _started_servers():
    """A ``start(**spawn_server_kwargs)`` function; every server it started is stopped on leaving."""
    started: list[ServerProcess] = []

    def start(**kwargs) -> ServerProcess:
        srv = spawn_server(**kwargs)
        started.append(srv)
        return srv

    try:
        yield start
    finally:
        for srv in started:
            srv.stop()


@pytest.fixture(scope="session")
def server():
    """The shared worker server for the whole test run."""
    with _started_servers() as start:
        yield start(token=TOKEN, name="test")


@pytest.fixture
def start_server():
    """Factory that starts extra servers (for tests that kill or abuse one); all killed after the test.

    ``start_server(token=..., name=..., extra_args=(...), env={...})``: the arguments of ``spawn_server``.
    """
    with _started_servers() as start:
        yield start


@pytest.fixture(scope="module")
def start_module_server():
    """``start_server`` for the module-scoped fixtures of a test file: its servers stop after the file's tests."""
    with _started_servers() as start:
        yield start


@pytest.fixture
def session_for():
    """Factory: ``session_for(*workers, token=TOKEN, **options)`` opens a ``remotorch.Session``.

    ``workers``: server processes (``ServerProcess`` or ``EmbeddedWorker``) or URLs; several (or a
    list) make a multi-worker session. After the test every session is closed, and the test fails if
    a worker process it was given died meanwhile (a URL is not checked: tests that stop servers pass URLs).
    """
    opened: list[tuple[remotorch.Session, list]] = []

    def open_session(*workers, token: str | None = TOKEN, **options) -> remotorch.Session:
        several = len(workers) != 1 or isinstance(workers[0], (list, tuple))
        flat = [w for item in workers for w in (item if isinstance(item, (list, tuple)) else [item])]
        urls = [w if isinstance(w, str) else w.url for w in flat]
        s = remotorch.Session(urls if several else urls[0], token=token, **options)
        opened.append((s, [w for w in flat if not isinstance(w, str)]))
        return s

    yield open_session
    for s, _ in opened:
        s.close()
    dead = {id(w): w for _, workers in opened for w in workers if not w.alive()}
    if dead:
        pytest.fail("worker(s) died during the test:\n" + "\n".join(
            f"{getattr(w, 'name', w.url)}: {w.stderr_text()[-4000:] if hasattr(w, 'stderr_text') else ''}"
            for w in dead.values()))


@pytest.fixture
def session(server, session_for):
    """A fresh Session to the shared server, closed after the test (which fails if the server died)."""
    return session_for(server)


@pytest.fixture
def make_session(server, session_for):
    """Factory for extra sessions to the shared server, or to ``url`` (one, or a list: all closed after the test)."""

    def make(url: str | list | None = None, token: str | None = TOKEN, **kwargs) -> remotorch.Session:
        return session_for(url or server, token=token, **kwargs)

    return make


# A loopback-only Ray: Ray binds and dials 127.0.0.1 instead of this host's network address
# (the switch Ray reads, once, when it is imported, for single-machine clusters on macOS and
# Windows). Set here, before any test module can import Ray; only Ray reads it.
RAY_TEST_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
os.environ.update(RAY_TEST_ENV)

# No disk cache for the workers of the suite (a per-user folder would carry uploads from one
# test, or one run, into the next): the cache's own tests name their folders. With
# REMOTORCH_TEST_CACHE=1 every worker of the run shares one fresh folder instead, so the whole
# suite runs through the cache's path (uploads by content id, Have, objects read back from disk).
SUITE_CACHE = tempfile.mkdtemp(prefix="remotorch-suite-cache-") if os.environ.get("REMOTORCH_TEST_CACHE") else None
os.environ["REMOTORCH_CACHE_DIR"] = SUITE_CACHE or "off"


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray for the whole test run (2 CPUs, no dashboard, a 150 MB object store), shut down at the end.

    Token authentication, on by default for a new local cluster in Ray 2.60,
    stays on, as users get it: the token is a random one given in
    ``RAY_AUTH_TOKEN`` (first of Ray's token sources), so Ray does not write
    ``~/.ray/auth_token`` into the home directory of whoever runs the tests
    (``RAY_AUTH_MODE=disabled`` would test a set-up users do not have; a
    temporary ``HOME`` would change it for every other test of the run).
    Ray and its processes listen on loopback only (``RAY_TEST_ENV``).
    """
    import ray  # part of the test extra: a missing Ray fails here rather than skipping

    if ray.is_initialized():
        pytest.fail("Ray was initialised before the ray_local fixture")
    from ray._private import ray_constants

    if ray_constants.ENABLE_RAY_CLUSTER:
        pytest.fail("Ray was imported before conftest.py set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0; "
                    "it would listen on this host's network address")
    saved = os.environ.get("RAY_AUTH_TOKEN")
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    try:
        ray.init(num_cpus=2, include_dashboard=False, object_store_memory=150 << 20, log_to_driver=False)
        assert ray.util.get_node_ip_address() == "127.0.0.1"
        yield ray
    finally:
        ray.shutdown()
        if saved is None:
            os.environ.pop("RAY_AUTH_TOKEN", None)
        else:
            os.environ["RAY_AUTH_TOKEN"] = saved


@pytest.fixture(autouse=True)
def _reset_dynamo():
    """Each test compiles from scratch: no dynamo cache entries leak between tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def seeded():
    torch.manual_seed(0)


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


@pytest.fixture(scope="session")
def zoo_worker():
    """One worker for the whole conformance suite, allowing transformers' custom operators (MoE experts)."""
    with _started_servers() as start:
        yield start(token=TOKEN, name="zoo", extra_args=("--allow-ops", "transformers"))


@pytest.fixture(scope="session")
def zoo_references(request, tmp_path_factory):
    """aot_eager outcomes of the zoo cases this run collected (tests/conformance/test_zoo.py), computed
    by a second process in the order the tests run, while this one runs them on remotorch."""
    from remotorch.devtools.conformance import References

    cases = [item.callspec.params["case"] for item in request.session.items
             if item.path.name == "test_zoo.py" and "case" in getattr(getattr(item, "callspec", None), "params", ())]
    refs = References(cases, str(tmp_path_factory.mktemp("aot_eager")))
    yield refs
    refs.close()

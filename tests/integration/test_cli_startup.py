"""The command line answers at once, and Ctrl-C ends any command cleanly, start-up included.

``--help``, ``top``, ``health``, ``token new`` and ``cache`` import neither
torch nor the worker: ``python -X importtime`` lists every module a command
imported, which makes the rule exact (how long it takes is the
benchmark's business, not a test's). Ctrl-C at a moment of a command's
start-up ends it with status 130 (0 for ``top``, whose normal way to stop it
is) and no traceback. Each moment is a sign the child gives, never a fixed
sleep: a module it finished importing (``-X importtime`` writes a line as each
one is done), a line it prints, a connection it opens. (Before its first
import of remotorch, a Ctrl-C meets the interpreter's own start-up, which is
Python's to answer.)
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys

import pytest

from remotorch.client.embedded import READY_PREFIX

from conftest import TOKEN, clean_env
from helpers import Lines, default_ctrl_c


def imported(stderr: str) -> list[str]:
    """The modules ``python -X importtime`` says were imported, in order."""
    return [line.rsplit("|", 1)[1].strip() for line in stderr.splitlines()
            if line.startswith("import time:") and "imported package" not in line]


def heavy(modules: list[str]) -> list[str]:
    return [m for m in modules if m.split(".")[0] == "torch" or m == "remotorch.worker"
            or m.startswith("remotorch.worker.")]


def run_light(args: list[str], *, code: str | None = None) -> subprocess.CompletedProcess:
    """``python -X importtime -m remotorch ARGS`` (or ``-c CODE ARGS``), finished."""
    how = ["-c", code] if code else ["-m", "remotorch"]
    return subprocess.run([sys.executable, "-X", "importtime", *how, *args], capture_output=True, text=True,
                          env=clean_env(), timeout=120)


CONSOLE_SCRIPT = "import sys; from remotorch.cli import main; sys.exit(main())"  # what the `remotorch` script runs

LIGHT = {
    "--help": ["--help"],
    "top --help": ["top", "--help"],
    "health --help": ["health", "--help"],
    "token new": ["token", "new", "alice"],
}


@pytest.mark.parametrize("name", sorted(LIGHT))
def test_a_light_command_imports_neither_torch_nor_the_worker(name):
    done = run_light(LIGHT[name])
    assert done.returncode == 0, done.stderr[-3000:]
    modules = imported(done.stderr)
    assert "remotorch.cli" in modules and not heavy(modules), heavy(modules)[:10]


def test_the_console_script_and_import_remotorch_are_light_too():
    for args, code in ((["--help"], CONSOLE_SCRIPT), ([], "import remotorch; remotorch.errors.RemoteError")):
        done = run_light(args, code=code)
        assert done.returncode == 0, done.stderr[-3000:]
        modules = imported(done.stderr)
        assert "remotorch" in modules and not heavy(modules), (code, heavy(modules)[:10])


def test_cache_listing_measuring_and_clearing_are_light(tmp_path):
    entry = tmp_path / "tensors" / "ab" / ("ab" * 16)
    entry.parent.mkdir(parents=True)
    entry.write_bytes(b"x" * 1000)
    for action, says in (("ls", "ab" * 8), ("du", str(tmp_path)), ("clear", "cleared")):
        done = run_light(["cache", action, "--cache-dir", str(tmp_path)])
        assert done.returncode == 0 and says in done.stdout, done.stdout + done.stderr[-3000:]
        assert not heavy(imported(done.stderr)), (action, heavy(imported(done.stderr))[:10])
    assert not entry.exists()


def test_health_and_top_ask_a_worker_without_torch(server):
    health = run_light(["health", server.url, "--token", TOKEN])
    top = run_light(["top", server.url, "--token", TOKEN, "--count", "1"])
    for done in (health, top):
        assert done.returncode == 0, done.stdout + done.stderr[-3000:]
        assert not heavy(imported(done.stderr)), heavy(imported(done.stderr))[:10]
    assert "healthy" in health.stdout and "eager" in health.stdout and "torch_version" in health.stdout
    assert f"test ({server.url})" in top.stdout and "tenants" in top.stdout


# --------------------------------------------------------------------------- Ctrl-C
def finished_importing(module: str):
    """The sign that the child has imported ``module`` (a line of ``-X importtime``)."""
    return lambda line: line.startswith("import time:") and line.rsplit("|", 1)[1].strip() == module


class Child:
    """``python -X importtime -m remotorch ARGS``, both of its streams read as they come."""

    def __init__(self, args: list[str]) -> None:
        self.args = args
        self.proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "remotorch", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(),
                                     preexec_fn=default_ctrl_c)
        self.out, self.err = Lines(self.proc.stdout), Lines(self.proc.stderr)

    def ctrl_c(self) -> tuple[int, str, str]:
        """Send SIGINT; the exit status, stdout and stderr once it ended (it must, within a minute)."""
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"remotorch {' '.join(self.args)} still ran a minute after Ctrl-C:\n"
                                 f"{self.err.text()[-4000:]}") from None
        return self.proc.returncode, self.out.text(), self.err.text()


def assert_clean_end(child: Child, status: int) -> str:
    code, out, err = child.ctrl_c()
    assert code == status and "Traceback" not in err, f"exit status {code}:\n{err[-4000:]}"
    return out


SERVE_MOMENTS = {
    "while the command line loads": ("err", finished_importing("remotorch.cli.serve")),
    "once torch is imported": ("err", finished_importing("torch")),
    "while the worker is made": ("err", finished_importing("remotorch.worker.server")),
    "once it serves": ("out", lambda line: line.startswith(READY_PREFIX)),
}


@pytest.mark.parametrize("moment", list(SERVE_MOMENTS))
def test_ctrl_c_ends_serve_with_130_at_any_moment_of_its_start(moment):
    child = Child(["serve", "--host", "127.0.0.1", "--port", "0", "--no-cache"])
    stream, sign = SERVE_MOMENTS[moment]
    getattr(child, stream).wait_for(sign)
    assert_clean_end(child, 130)


@pytest.fixture
def silent_worker():
    """A loopback port that accepts connections and never answers: a worker that hangs."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(120)
        yield listener


@pytest.mark.parametrize("moment", ["while the command line loads", "while it imports the client",
                                    "while it waits for the worker"])
def test_ctrl_c_ends_health_with_130_at_any_moment(silent_worker, moment):
    url = "tcp://127.0.0.1:%d" % silent_worker.getsockname()[1]
    child = Child(["health", url, "--token", TOKEN, "--timeout", "120"])
    if moment == "while the command line loads":
        child.err.wait_for(finished_importing("remotorch.cli.serve"))
    elif moment == "while it imports the client":
        child.err.wait_for(finished_importing("remotorch.client.probe"))
    else:
        conn, _ = silent_worker.accept()  # health connected, and waits for the handshake's answer
    assert_clean_end(child, 130)


@pytest.mark.parametrize("moment", ["while it imports the client", "after its first refresh"])
def test_ctrl_c_ends_top_with_0_at_any_moment(server, moment):
    child = Child(["top", server.url, "--token", TOKEN, "--interval", "0.2"])
    if moment == "while it imports the client":
        child.err.wait_for(finished_importing("remotorch.client.probe"))
    else:
        child.out.wait_for(lambda line: f"test ({server.url})" in line)
    assert_clean_end(child, 0)

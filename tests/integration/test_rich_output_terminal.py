"""Progress bars at a real terminal, and none in pipes: scripts against a real worker in a pseudo-terminal.

As a user at a terminal runs them. The same tables and bars forced on or off
in process: unit/test_rich_output.py.
"""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import textwrap

import pytest
import torch

import remotorch
from conftest import TOKEN, clean_env

ESC = "\x1b["


def test_a_large_upload_forced_to_show_its_bar(server, capsys):
    model = torch.nn.Linear(4096, 4352, bias=False)  # 68 MiB of weights
    x = torch.randn(2, 4096)
    with remotorch.Session(server.url, token=TOKEN, progress=True) as s:
        f = remotorch.compile(model, session=s, fallback="raise")
        with torch.no_grad():
            torch.testing.assert_close(f(x), model(x))
    err = capsys.readouterr().err
    assert "uploading 1 weight tensor(s) to test" in err and "MB" in err  # (the worker, by its name)


SCRIPT = textwrap.dedent('''
    import logging, sys, torch, remotorch
    if "quiet" in sys.argv:
        logging.getLogger("remotorch").setLevel(logging.ERROR)
    model = torch.nn.Linear(4096, 4352, bias=False)  # 68 MiB of weights
    x = torch.randn(2, 4096)
    with torch.no_grad():
        y = torch.compile(model, backend="remotorch", options={"fallback": "raise"})(x)
        assert torch.allclose(y, model(x), atol=1e-4)
        fast = remotorch.accelerate(lambda v: v * 2, local_backend="eager")
        with remotorch.remote_profile(backends=["test/eager"], num_repeats=1) as prof:
            for _ in range(3):
                fast(torch.randn(4))
    prof.report().print()
    print("done")
''')


def run_in_terminal(args: list[str], env: dict, timeout: float = 300) -> str:
    """Run a command with stdin, stdout and stderr on a new pseudo-terminal; all it wrote."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    out = bytearray()
    try:
        while select.select([master], [], [], timeout)[0]:
            try:
                data = os.read(master, 1 << 16)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            out += data
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        os.close(master)
    assert proc.returncode == 0, out.decode(errors="replace")[-3000:]
    return out.decode(errors="replace")


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "user_script.py"
    path.write_text(SCRIPT)
    return str(path)


def test_at_a_terminal_uploads_and_profiles_show_bars(server, script):
    env = clean_env(REMOTORCH_URL=server.url, REMOTORCH_TOKEN=TOKEN, COLUMNS="120", TERM="xterm")
    out = run_in_terminal([sys.executable, script], env)
    assert "uploading 1 weight tensor(s) to test" in out  # (the worker, by its name)
    assert "profiling on 1 backend(s): calls" in out
    assert ESC in out and "done" in out  # the report itself is drawn too


def test_no_bars_in_pipes_when_switched_off_or_when_logging_is_quiet(server, script):
    env = clean_env(REMOTORCH_URL=server.url, REMOTORCH_TOKEN=TOKEN, COLUMNS="120", TERM="xterm")
    piped = subprocess.run([sys.executable, script], capture_output=True, text=True, env=env, timeout=300)
    assert piped.returncode == 0, piped.stderr[-3000:]
    assert "uploading" not in piped.stderr and "profiling on" not in piped.stderr
    assert ESC not in piped.stdout and "done" in piped.stdout
    off = run_in_terminal([sys.executable, script], dict(env, REMOTORCH_PROGRESS="0"))
    quiet = run_in_terminal([sys.executable, script, "quiet"], env)
    for out in (off, quiet):
        assert "uploading" not in out and "profiling on" not in out and "done" in out

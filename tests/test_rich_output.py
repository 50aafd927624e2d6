"""Tables drawn for terminals and plain for logs; progress bars only where someone watches.

The terminal branch is tested two ways: by forcing it (``terminal=True``, a
file that says it is a TTY) and by running scripts in a real pseudo-terminal,
as a user at a terminal runs them. Pipes (what tests and CI have) get plain
text with no escape codes and no bars.
"""

from __future__ import annotations

import io
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
from remotorch.client.progress import UPLOAD_BAR_BYTES, bar, upload_bar
from remotorch.profile.tables import table, to_text
from test_profile_report import call, report_of

ESC = "\x1b["


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def sample_report():
    backends = ["w/eager", "w/onnxrt"]
    records = [call("f", ["g1"], gaps=(1.0, 2.0), times={b: [1.0, 3.0] for b in backends}) for _ in range(2)]
    return report_of(records, backends=backends)


def test_report_is_plain_for_files_and_drawn_for_terminals():
    report = sample_report()
    plain = report.render()
    assert ESC not in plain and "─" not in plain
    lines = plain.splitlines()
    head = lines.index("sequence 1: f, 1 graph(s), 2 call(s), 2 timed")
    assert lines[head + 1].split() == ["segment", "backend", "runs", "mean", "ms", "p50", "ms", "p95", "ms",
                                       "failures"]
    assert set(lines[head + 2].replace(" ", "")) == {"-"}  # the rule under the header
    assert lines[head + 4].split()[-4:] == ["4", "2.000", "2.000", "3.000"]  # w/eager: 2 calls x 2 runs
    assert all(line == line.rstrip() for line in lines)
    drawn = report.render(terminal=True)
    assert ESC in drawn and "─" in drawn
    for text in ("w/eager", "w/onnxrt", "2.000", "per call, estimated"):
        assert text in drawn
    tty, log = FakeTTY(), io.StringIO()
    report.print(tty)
    report.print(log)
    assert ESC in tty.getvalue() and log.getvalue().rstrip("\n") == plain


def test_tables_align_numbers_right_and_text_left():
    text = to_text(table(("name", "ms"), [["a", "1.5"], ["long name", "12.25"]], terminal=False), terminal=False)
    assert text.splitlines() == ["  name          ms", "  ---------  -----", "  a            1.5",
                                 "  long name  12.25"]


def test_explanation_prints_plain_or_drawn(capsys):
    e = remotorch.explain(lambda x: torch.relu(x) + 1, torch.randn(3))
    e.print()
    plain = capsys.readouterr().out
    assert ESC not in plain and "1 graph(s), 0 graph break(s)" in plain and "graph 1" in plain
    e.print(terminal=True)
    drawn = capsys.readouterr().out
    assert ESC in drawn and "operations" in drawn


def test_bars_only_where_wanted(capsys):
    with bar("work", 3, unit="items") as advance:  # stderr is not a terminal under pytest
        advance(3)
    assert capsys.readouterr().err == ""
    stream = FakeTTY()
    with bar("counting things", 2, unit="items", stream=stream, enabled=True) as advance:
        advance(1)
        advance(1)
    assert "counting things" in stream.getvalue() and "2/2" in stream.getvalue()
    small = FakeTTY()
    with upload_bar("uploading small", UPLOAD_BAR_BYTES - 1, enabled=True, stream=small) as advance:
        advance(10)
    assert small.getvalue() == ""  # under the threshold: no bar, even when forced


def test_a_large_upload_forced_to_show_its_bar(server, capsys):
    model = torch.nn.Linear(4096, 4352, bias=False)  # 68 MiB of weights
    x = torch.randn(2, 4096)
    with remotorch.Session(server.url, token=TOKEN, progress=True) as s:
        f = remotorch.compile(model, session=s, fallback="raise")
        with torch.no_grad():
            torch.testing.assert_close(f(x), model(x))
    err = capsys.readouterr().err
    assert f"uploading 1 weight tensor(s) to {server.url}" in err and "MB" in err


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
    assert f"uploading 1 weight tensor(s) to {server.url}" in out
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

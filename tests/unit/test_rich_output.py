"""Tables drawn for terminals and plain for logs; progress bars only where someone watches.

The terminal branch is forced here (``terminal=True``, a file that says it is
a TTY); integration/test_rich_output_terminal.py runs scripts against a real
worker in a real pseudo-terminal, as a user at a terminal runs them. Pipes
(what tests and CI have) get plain text with no escape codes and no bars.
"""

from __future__ import annotations

import io

import torch

import remotorch
from remotorch.client.progress import UPLOAD_BAR_BYTES, bar, upload_bar
from remotorch.profile.tables import table, to_text

from profile_helpers import call, report_of

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

"""Pipeline schedules as data: building, text form, validation, simulation, the chart and the command line.

These need no workers: a schedule is data, and its checks and timings are
computed on the client. Timelines are checked against the dependency rules
written out again here, from the documentation, not through the module's
own ``dependencies``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remotorch.pipeline.chart import figures, render, write_png
from remotorch.pipeline.builders import build
from remotorch.pipeline.schedules import Action, Schedule, ScheduleError, parse, validate
from remotorch.pipeline.simulate import Timeline, simulate

NAMES = ("GPipe", "1F1B", "Interleaved1F1B")


def grid():
    """(name, stages, microbatches, build keywords): every name x 2..8 stages x 1..16 microbatches,
    1..3 chunks per worker, and every number of workers below the number of stages."""
    for name in NAMES:
        for stages in range(2, 9):
            for microbatches in range(1, 17):
                for chunks in (1, 2, 3):
                    if stages % chunks == 0:
                        yield name, stages, microbatches, {"chunks": chunks}
                for workers in range(1, stages):
                    if stages % workers or workers == 1:  # uneven placements (the even ones are chunks above)
                        yield name, stages, microbatches, {"workers": workers}


def check_rules(t: Timeline, forward=1.0, backward=2.0, comm=0.0) -> None:
    """Every span obeys the rules: per worker in order and one at a time, each action after what it needs
    (plus comm when that ran on another worker), lasting its cost."""
    s = t.schedule
    fwd = forward if isinstance(forward, list) else [forward] * s.stages
    bwd = backward if isinstance(backward, list) else [backward] * s.stages
    ends = {}
    for w, row in enumerate(t.spans):
        assert [sp.action for sp in row] == list(s.order[w])
        for prev, sp in zip(row, row[1:]):
            assert sp.start >= prev.end
        for sp in row:
            cost = fwd[sp.action.stage] if sp.action.kind == "F" else bwd[sp.action.stage]
            assert sp.end - sp.start == pytest.approx(cost)
            ends[str(sp.action)] = (sp.end, w)
    for w, row in enumerate(t.spans):
        for sp in row:
            st, kind, m = sp.action.stage, sp.action.kind, sp.action.microbatch
            needs = ([f"{st - 1}F{m}"] if kind == "F" and st > 0 else []) + \
                    ([f"{st}F{m}"] if kind == "B" else []) + \
                    ([f"{st + 1}B{m}"] if kind == "B" and st + 1 < s.stages else [])
            for need in needs:
                end, where = ends[need]
                assert sp.start >= end + (comm if where != w else 0.0) - 1e-9, (sp.action, need)


# ---------------------------------------------------------------- the required figures

@pytest.mark.parametrize("name", ["GPipe", "1F1B"])
def test_gpipe_and_1f1b_on_4_stages_and_8_microbatches_have_a_bubble_of_3_11(name):
    t = simulate(build(name, 4, 8), forward=1.0, backward=2.0)
    assert t.bubble_fraction == 3 / 11
    idle = sum(t.total - sum(sp.end - sp.start for sp in row) for row in t.spans)
    assert Fraction(idle) / Fraction(4 * t.total) == Fraction(3, 11)  # recomputed from the spans
    assert t.total == (8 + 4 - 1) * 3  # (M + S - 1) (f + b)
    check_rules(t)


def test_1f1b_holds_4_microbatches_on_the_first_worker_where_gpipe_holds_8():
    one_f_one_b, gpipe = simulate(build("1F1B", 4, 8)), simulate(build("GPipe", 4, 8))
    assert one_f_one_b.peak_activations[0] == 4
    assert gpipe.peak_activations[0] == 8
    assert one_f_one_b.peak_activations == (4, 3, 2, 1)  # S - w on worker w
    assert gpipe.peak_activations == (8, 8, 8, 8)


def test_textbook_1f1b_order():
    s = build("1f1b", 4, 8)  # names are case-insensitive
    assert s.name == "1F1B"
    assert s.text().splitlines()[0] == "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7"
    assert s.text().splitlines()[3] == " ".join(f"3F{m} 3B{m}" for m in range(8))


def test_interleaved_lowers_the_bubble():
    interleaved = build("Interleaved1F1B", 8, 8, chunks=2)
    assert interleaved.workers == 4 and interleaved.stages_of(1) == (1, 5)
    t_i, t_1 = simulate(interleaved), simulate(build("1F1B", 4, 8))
    assert t_i.bubble_fraction < t_1.bubble_fraction
    check_rules(t_i)


@pytest.mark.parametrize("workers,chunks", [(2, 2), (2, 3), (3, 2), (4, 2), (4, 3), (5, 2)])
def test_interleaved_reaches_megatrons_makespan(workers, chunks):
    """With a whole number of rounds of W microbatches, the bubble is (W - 1)(f + b), not (W - 1) chunks' worth."""
    for microbatches in (workers, 2 * workers, 3 * workers):
        t = simulate(build("Interleaved1F1B", workers * chunks, microbatches, chunks=chunks))
        assert t.total == (chunks * microbatches + workers - 1) * 3
        assert max(t.peak_activations) <= chunks * microbatches


def test_three_stages_on_two_workers():
    s = build("1F1B", 3, 4, workers=2)
    assert s.placement == (0, 1, 0)
    assert s.stages_of(0) == (0, 2) and s.stages_of(1) == (1,)
    t = simulate(s)
    check_rules(t)
    assert sum(t.busy) == 3 * 4 * 3


def test_1f1b_with_fewer_microbatches_than_stages():
    for stages in range(2, 9):
        for microbatches in range(1, stages):
            t = simulate(build("1F1B", stages, microbatches))
            check_rules(t)
            assert t.peak_activations[0] == microbatches
            assert t.total == (microbatches + stages - 1) * 3


# ---------------------------------------------------------------- every built schedule

def test_every_built_schedule_validates_simulates_and_round_trips_as_text():
    count = 0
    for name, stages, microbatches, kw in grid():
        s = build(name, stages, microbatches, **kw)
        assert validate(s) is s
        assert s.placement == tuple(st % s.workers for st in range(stages))
        assert sorted(str(a) for row in s.order for a in row) == \
            sorted(f"{st}{k}{m}" for st in range(stages) for m in range(microbatches) for k in "FB")
        t = simulate(s)
        assert sum(t.busy) == stages * microbatches * 3
        assert 0 <= t.bubble_fraction < 1
        assert parse(s.text(), name=s.name) == s
        count += 1
    assert count > 1500


@pytest.mark.parametrize("name", NAMES)
def test_built_timelines_obey_the_rules_with_measured_costs_and_comm(name):
    forward, backward = [1.0, 0.5, 2.0, 1.25, 0.75, 1.0], [2.0, 1.0, 3.5, 2.5, 1.5, 2.0]
    for kw in ({"chunks": 1}, {"chunks": 2}, {"workers": 4}, {"workers": 5}):
        t = simulate(build(name, 6, 7, **kw), forward=forward, backward=backward, comm=0.3)
        check_rules(t, forward, backward, comm=0.3)
        assert sum(t.busy) == pytest.approx(7 * (sum(forward) + sum(backward)))


def test_comm_costs_only_across_workers():
    base, slow = simulate(build("1F1B", 4, 8)), simulate(build("1F1B", 4, 8), comm=0.5)
    assert slow.total > base.total
    alone = build("1F1B", 4, 8, workers=1)
    assert simulate(alone, comm=5.0).total == simulate(alone).total == 4 * 8 * 3


def test_timeline_to_dict_is_json():
    t = simulate(build("GPipe", 2, 3))
    d = json.loads(json.dumps(t.to_dict()))
    assert d["bubble_fraction"] == t.bubble_fraction and d["total"] == t.total
    assert d["peak_activations"] == [3, 3]
    assert d["spans"][1][0] == {"action": "1F0", "start": 1.0, "end": 2.0}


def needs_of(action: str, stages: int) -> set[str]:
    """The rules as documented, on action texts (single-digit stages)."""
    s, kind, m = int(action[0]), action[1], int(action[2:])
    if kind == "F":
        return {f"{s - 1}F{m}"} if s else set()
    return {f"{s}F{m}"} | ({f"{s + 1}B{m}"} if s + 1 < stages else set())


def runs_to_the_end(s: Schedule) -> bool:
    """The oracle: pop any worker's next action whose needs are done, until none can go on."""
    done, lists = set(), [list(map(str, row)) for row in s.order]
    progress = True
    while progress:
        progress = False
        for row in lists:
            while row and needs_of(row[0], s.stages) <= done:
                done.add(row.pop(0))
                progress = True
    return not any(lists)


@st.composite
def random_schedules(draw):
    """Per worker, a random order of its own actions, every backward after its forward. Half of them are
    drawn as one random execution of the whole pipeline (so they run to the end), half shuffled freely
    (mostly deadlocks)."""
    stages = draw(st.integers(2, 5))
    workers = draw(st.integers(1, stages))
    microbatches = draw(st.integers(1, 4))
    placement = tuple(s % workers for s in range(stages))
    order = [[] for _ in range(workers)]
    if draw(st.booleans()):
        done, left = set(), {f"{s}{k}{m}" for s in range(stages) for k in "FB" for m in range(microbatches)}
        while left:
            ready = [a for a in sorted(left) if needs_of(a, stages) <= done]
            a = ready[draw(st.integers(0, len(ready) - 1))]
            order[placement[int(a[0])]].append(a)
            done.add(a)
            left.discard(a)
    else:
        for w in range(workers):
            pending = [[f"{s}F{m}", f"{s}B{m}"] for s in range(w, stages, workers) for m in range(microbatches)]
            while pending:
                pair = pending[draw(st.integers(0, len(pending) - 1))]
                order[w].append(pair.pop(0))
                pending = [p for p in pending if p]
    return Schedule("random", stages, microbatches, placement, order)


@settings(max_examples=300, deadline=None)
@given(random_schedules())
def test_random_orders_are_valid_exactly_when_they_run_to_the_end(s):
    if runs_to_the_end(s):
        assert validate(s) is s
        check_rules(simulate(s, forward=1.0, backward=2.0, comm=0.25), comm=0.25)
    else:
        with pytest.raises(ScheduleError, match="deadlock") as info:
            validate(s)
        e = info.value
        assert str(s.order[e.worker][e.position]) == e.action


# ---------------------------------------------------------------- text form and actions

def test_action_text():
    assert str(Action(0, "F", 1)) == "0F1"
    assert Action.parse("12B3") == Action(12, "B", 3)
    assert Action.parse(" 1b0 ") == Action(1, "B", 0)
    with pytest.raises(ScheduleError, match="unknown kind 'X'"):
        Action.parse("0X1")
    with pytest.raises(ScheduleError, match="not an action"):
        Action.parse("F1")


def test_parse_infers_placement_stages_and_microbatches():
    s = parse("# two workers\n0F0, 0F1, 2F0, 2F1 2B0 2B1 0B0 0B1\n\n1F0 1F1 1B0 1B1  # worker 1\n")
    assert (s.stages, s.microbatches, s.placement, s.workers) == (3, 2, (0, 1, 0), 2)
    assert s.name == "custom"
    assert validate(s) is s
    with pytest.raises(ScheduleError, match="stage 1 appears on no line"):
        parse("0F0 0B0\n2F0 2B0")


def test_a_hand_written_schedule_in_the_constructor():
    s = Schedule("mine", 2, 1, [0, 1], [["0F0", "0B0"], [Action(1, "F", 0), "1B0"]])
    assert s.order[0] == (Action(0, "F", 0), Action(0, "B", 0))
    assert validate(s).text() == "0F0 0B0\n1F0 1B0"
    with pytest.raises(ScheduleError, match="no idle entries"):
        Schedule("idle", 2, 1, [0, 1], [["0F0", None, "0B0"], ["1F0", "1B0"]])


# ---------------------------------------------------------------- invalid schedules name the first bad action

GOOD = "0F0 0F1 0B0 0B1\n1F0 1B0 1F1 1B1"


def error_of(text: str, **kw) -> ScheduleError:
    with pytest.raises(ScheduleError) as info:
        validate(parse(text, **kw))
    return info.value


def test_the_good_example_is_good():
    assert validate(parse(GOOD)).workers == 2


def test_missing_action():
    e = error_of("0F0 0F1 0B0 0B1\n1F0 1B0 1F1", stages=2, microbatches=2)
    assert e.action == "1B1" and e.worker == 1
    assert "1B1 is missing" in str(e)


def test_duplicate_action():
    e = error_of("0F0 0F1 0B0 0B1 0F1\n1F0 1B0 1F1 1B1")
    assert (e.worker, e.position, e.action) == (0, 4, "0F1")
    assert "duplicate of worker 0, position 1" in str(e)


def test_action_on_the_wrong_worker():
    e = error_of("0F0 0F1 0B0\n1F0 1B0 1F1 1B1 0B1")  # stage 0 is placed on the first line that has it
    assert (e.worker, e.position, e.action) == (1, 4, "0B1")
    assert "wrong worker: stage 0 is placed on worker 0" in str(e)
    s = Schedule("mine", 2, 1, (0, 1), [["0F0", "0B0", "1F0"], ["1B0"]])
    with pytest.raises(ScheduleError, match="position 2: 1F0 is on the wrong worker"):
        validate(s)


def test_stage_and_microbatch_out_of_range():
    e = error_of(GOOD + " 1F2", microbatches=2)
    assert (e.worker, e.position, e.action) == (1, 4, "1F2") and "microbatch 2" in str(e)
    s = parse(GOOD)
    wide = Schedule("wide", 1, 2, (0,), s.order)
    with pytest.raises(ScheduleError, match="names stage 1; the schedule has 1 stages") as info:
        validate(wide)
    assert (info.value.worker, info.value.position) == (1, 0)


def test_backward_before_its_forward():
    e = error_of("0F0 0F1 0B0 0B1\n1F0 1B0 1B1 1F1")
    assert (e.worker, e.position, e.action) == (1, 2, "1B1")
    assert "before its own forward 1F1 (position 3)" in str(e)


def test_deadlock_names_the_stuck_actions():
    e = error_of("0F0 0B0 0F1 0B1\n1F1 1B1 1F0 1B0")
    assert (e.worker, e.position, e.action) == (0, 1, "0B0")
    assert "deadlock" in str(e)
    assert "worker 0 waits at position 1 (0B0) for 1B0 (worker 1, position 3)" in str(e)
    assert "worker 1 waits at position 0 (1F1) for 0F1 (worker 0, position 2)" in str(e)


def test_deadlock_across_three_workers_with_an_uneven_placement():
    # worker 0 holds stages 0 and 2, and waits for 2B0 before running 0F1 that worker 1 needs
    e = error_of("0F0 2F0 0B0 0F1 2F1 2B1 2B0 0B1\n1F1 1F0 1B0 1B1")
    assert "deadlock" in str(e) and e.worker == 0


def test_bad_text():
    with pytest.raises(ScheduleError) as info:
        parse("0F0 0B0\n1F0 1Q0")
    e = info.value
    assert (e.worker, e.position, e.action) == (1, 1, "1Q0")
    assert "line 2, item 2" in str(e) and "unknown kind 'Q'" in str(e)
    with pytest.raises(ScheduleError, match="line 1, item 3: 'x' is not an action"):
        parse("0F0 0B0 x")
    with pytest.raises(ScheduleError, match="no actions"):
        parse("\n# nothing\n")


def test_bad_shapes():
    s = parse(GOOD)
    with pytest.raises(ScheduleError, match="placement names a worker for 1 stages"):
        validate(Schedule("p", 2, 2, (0,), s.order))
    with pytest.raises(ScheduleError, match="puts stage 1 on worker 2"):
        validate(Schedule("p", 2, 2, (0, 2), s.order))
    with pytest.raises(ScheduleError, match="microbatches >= 1"):
        validate(Schedule("p", 2, 0, (0, 1), s.order))


def test_build_refuses_bad_arguments_clearly():
    with pytest.raises(ScheduleError, match="unknown schedule 'ZB1P': the known ones are GPipe, 1F1B, "
                                            "Interleaved1F1B"):
        build("ZB1P", 4, 8)
    with pytest.raises(ScheduleError, match="5 stages do not split into 2 chunks"):
        build("Interleaved1F1B", 5, 8, chunks=2)
    with pytest.raises(ScheduleError, match="a worker without a stage"):
        build("1F1B", 3, 8, workers=4)
    with pytest.raises(ScheduleError, match="microbatches must be an integer >= 1"):
        build("1F1B", 3, 0)
    with pytest.raises(ScheduleError, match="give chunks or workers, not both"):
        build("1F1B", 6, 4, chunks=3, workers=3)
    assert build("1F1B", 6, 4, chunks=2, workers=3) == build("1F1B", 6, 4, chunks=2)


def test_simulate_refuses_bad_costs():
    s = build("1F1B", 4, 8)
    with pytest.raises(ScheduleError, match="3 given for 4 stages"):
        simulate(s, forward=[1, 1, 1])
    with pytest.raises(ScheduleError, match="finite numbers >= 0"):
        simulate(s, backward=-1)
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(parse("0F0 0B0 0F1 0B1\n1F1 1B1 1F0 1B0"))


def test_pipeline_schedules_import_nothing_heavy():
    """torch and matplotlib are imported by none of these modules at import time (chart imports matplotlib
    inside write_png only)."""
    import ast
    from pathlib import Path

    from remotorch import pipeline

    for name in ("__init__", "schedules", "simulate", "chart"):
        tree = ast.parse((Path(pipeline.__file__).parent / f"{name}.py").read_text())
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        modules = {a.name for n in top if isinstance(n, ast.Import) for a in n.names} | \
                  {n.module or "" for n in top if isinstance(n, ast.ImportFrom)}
        assert not {m for m in modules if m.split(".")[0] in ("torch", "matplotlib", "numpy")}, name
    assert pipeline.builders.SCHEDULES == NAMES


# ---------------------------------------------------------------- chart and command line

def test_text_chart_and_figures():
    t = simulate(build("1F1B", 4, 8))
    lines = render(t).splitlines()
    assert lines[1].startswith("w0 F0 F1 F2 F3 .") and lines[1].endswith("B7")
    assert lines[4].startswith("w3 .........F0 B0    F1 B1")
    text = figures(t)
    assert "bubble fraction   0.2727" in text and "makespan          33" in text
    assert "w0 4, w1 3, w2 2, w3 1" in text
    # several stages on a worker: the stage is named; squeezed: only the kind
    assert "2F0" in render(simulate(build("1F1B", 3, 4, workers=2)))
    squeezed = render(simulate(build("GPipe", 8, 32)), width=60).splitlines()
    assert all(len(line) <= 63 for line in squeezed) and "FFF" in squeezed[1] and "BBB" in squeezed[1]


def test_png(tmp_path):
    path = tmp_path / "t.png"
    write_png(simulate(build("Interleaved1F1B", 4, 4, chunks=2)), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def remotorch_cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "remotorch", "schedule", *args], capture_output=True,
                          text=True, timeout=120, cwd=cwd)


def test_cli_chart_figures_and_png(tmp_path):
    png = tmp_path / "1f1b.png"
    proc = remotorch_cli("1F1B", "--stages", "4", "--microbatches", "8", "--png", str(png))
    assert proc.returncode == 0, proc.stderr
    assert "w0 F0 F1 F2 F3 ." in proc.stdout and "w3 .........F0 B0" in proc.stdout
    assert "bubble fraction   0.2727" in proc.stdout and "makespan          33" in proc.stdout
    assert "peak activations  w0 4, w1 3, w2 2, w3 1" in proc.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_invalid_file_exits_2_with_the_message(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("0F0 0B0 0F1 0B1\n1F1 1B1 1F0 1B0\n")
    proc = remotorch_cli("--file", str(bad))
    assert proc.returncode == 2
    assert f"{bad}: deadlock" in proc.stderr and "worker 0 waits at position 1 (0B0)" in proc.stderr
    assert proc.stdout == ""


def test_cli_text_form_feeds_back_into_file(tmp_path, capsys):
    from remotorch.cli import main

    assert main(["schedule", "Interleaved1F1B", "--stages", "8", "--microbatches", "8", "--chunks", "2",
                 "--text"]) == 0
    text = capsys.readouterr().out
    assert text.strip() == build("Interleaved1F1B", 8, 8, chunks=2).text()
    good = tmp_path / "good.txt"
    good.write_text(text)
    assert main(["schedule", "--file", str(good), "--forward", "1", "--backward", "2", "--comm", "0"]) == 0
    out = capsys.readouterr().out
    assert "bubble fraction   0.1579" in out and "w0 0F0 0F1" in out
    assert main(["schedule", "--file", str(good), "--forward", "1,1,1,1,1,1,1,2", "--width", "40"]) == 0
    out = capsys.readouterr().out
    assert "forward 1/1/1/1/1/1/1/2" in out
    assert all(len(line) <= 43 for line in out.split("\n\n")[0].splitlines())


@pytest.mark.parametrize("args,message", [
    (["ZB1P", "--stages", "4", "--microbatches", "8"], "known ones are GPipe, 1F1B, Interleaved1F1B"),
    (["1F1B", "--stages", "4"], "with --stages and --microbatches, or --file FILE"),
    (["1F1B", "--file", "x.txt"], "not both"),
    (["--file", "no-such-file.txt"], "No such file"),
    (["1F1B", "--stages", "4", "--microbatches", "8", "--forward", "1,2"], "2 given for 4 stages"),
])
def test_cli_refuses_bad_arguments(capsys, args, message):
    from remotorch.cli import main

    assert main(["schedule", *args]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""

"""The table and the targets of ``benchmarks/wan.py``."""

from __future__ import annotations

import statistics

from _wan.cases import CASES, CONTROL, REMOTORCH

TARGET_RTT = 20.0
# (case, limit on (remote - local) / RTT per step, at TARGET_RTT ms)
RATIO_TARGETS = (("train", 1.2), ("train10", 0.2), ("branch", 2.2), ("generate", 1.05), ("infer", 1.1))
WIRE_SLACK = 1024  # bytes a training step may send beyond its inputs
# eager calls on kept values (case 8): round trips beyond local per unit, at every RTT measured
EAGER_TARGETS = (("eager_log", 1.1), ("eager_chain", 1.1))


def print_table(rows: list[dict], say) -> None:
    """Every row, by case, then system, then RTT. ``waits``: round trips the code waited for (remotorch's
    ``blocking_reads``; the peers' blocking calls); ``full``: waits because remotorch's queue was full."""
    say(f"\n  {'case / system':44s} {'RTT':>4s} {'remote':>8s} {'local':>7s} {'(r-l)/RTT':>9s} {'waits':>6s} "
        f"{'reqs':>5s} {'full':>5s} {'up B':>7s} {'down B':>8s} {'net CPU':>7s}")
    say(f"  {'':44s} {'ms':>4s} {'ms/step':>8s} {'ms/step':>7s} {'per step':>9s} {'/step':>6s} {'/step':>5s} "
        f"{'/step':>5s} {'/step':>7s} {'/step':>8s} {'ms/step':>7s}")
    for case, title in CASES.items():
        mine = [r for r in rows if r["case"] == case]
        if not mine:
            continue
        say(f"  {title}")
        systems = list(dict.fromkeys(r["system"] for r in mine))
        for system in systems:
            theirs = sorted((r for r in mine if r["system"] == system), key=lambda r: r["rtt_ms"])
            for r in theirs:
                up, down = client_bytes(r)
                say(f"    {system:42s} {r['rtt_ms']:4g} {r['remote_ms']:8.2f} {r['local_ms']:7.2f} "
                    f"{r['over_rtt']:9.3f} {_num(r.get('blocking_reads_per_step'), 6, 2)} "
                    f"{_num(r.get('requests_per_step'), 5, 1)} {_num(r.get('queue_waits_per_step'), 5, 2)} "
                    f"{_num(up, 7, 0)} {_num(down, 8, 0)} {_num(r.get('relay_cpu_ms_per_step'), 7, 2)}")
            if theirs[0]["note"]:
                say(f"      ({theirs[0]['note']})")


def client_bytes(row: dict) -> tuple[float | None, float | None]:
    """Bytes per step the client sent and received: remotorch's own count, else the proxy's."""
    if row["system"].startswith(REMOTORCH):
        return row.get("bytes_sent_per_step"), row.get("bytes_received_per_step")
    return row.get("wire_up_per_step"), row.get("wire_down_per_step")


def _num(v, width: int, digits: int) -> str:
    return f"{'n/a':>{width}s}" if v is None else f"{v:{width}.{digits}f}"


def _row(rows: list[dict], case: str, system: str, rtt: float) -> dict | None:
    found = [r for r in rows if r["case"] == case and r["system"] == system and r["rtt_ms"] == rtt]
    return found[0] if found else None


def judge(runs: list[list[dict]], step_inputs: int) -> list[dict]:
    """The targets at TARGET_RTT, each on the median of the runs' values (a target without rows is left out)."""
    targets = []

    def add(name: str, values: list, limit: float, strict: bool = False, unit: str = "") -> None:
        values = [v for v in values if v is not None]
        if not values:
            return
        value = statistics.median(values)
        targets.append({"name": name, "value": value, "per_run": values, "limit": limit, "unit": unit,
                        "pass": value < limit if strict else value <= limit, "strict": strict})

    for case, limit in RATIO_TARGETS:
        add(f"{CASES[case]}: (remote - local) / RTT", [_get(run, case, REMOTORCH, "over_rtt") for run in runs], limit)
    for case, peer_systems, strict in (("train", ("torch RPC rpc_sync", "Ray (modelled)"), False),
                                       ("train10", ("torch RPC rpc_async x10", "Ray (modelled)"), True)):
        for peer in peer_systems:
            # the extra time per step over local (each measured against its own local run) vs the peer's
            diffs = []
            for run in runs:
                mine, theirs = _row(run, case, REMOTORCH, TARGET_RTT), _row(run, case, peer, TARGET_RTT)
                if mine and theirs:
                    diffs.append(mine["over_rtt"] - theirs["over_rtt"])
            add(f"{CASES[case]}: remotorch - {peer}, x RTT per step", diffs, 0.0, strict=strict)
    rtts = sorted({r["rtt_ms"] for run in runs for r in run})
    for case, limit in EAGER_TARGETS:
        for rtt in rtts:
            rows = [_row(run, case, REMOTORCH, rtt) for run in runs]
            add(f"{CASES[case]} at {rtt:g} ms: (remote - local) / RTT", [r and r["over_rtt"] for r in rows], limit)
    add(f"{CASES['train']}: bytes sent per step (inputs {step_inputs} B + {WIRE_SLACK})",
        [_get(run, "train", REMOTORCH, "bytes_sent_per_step") for run in runs], step_inputs + WIRE_SLACK, unit="B")
    return targets


def _get(run: list[dict], case: str, system: str, key: str):
    row = _row(run, case, system, TARGET_RTT)
    return None if row is None else row.get(key)


def controls(runs: list[list[dict]]) -> dict[str, list[float]]:
    """The control rows' (remote - local) / RTT at TARGET_RTT, per case, one value per run."""
    out: dict[str, list[float]] = {}
    for run in runs:
        for case in CASES:
            value = _get(run, case, CONTROL, "over_rtt")
            if value is not None:
                out.setdefault(case, []).append(value)
    return out


def print_targets(targets: list[dict], runs_rows: list[list[dict]], say, echo_ms: list[float] | None = None) -> None:
    """The targets, each control's floor and, given ``echo_ms`` (a bare round trip through the proxy at
    TARGET_RTT, one per run), what remotorch costs beyond it on the controls' cases."""
    n_runs = len(runs_rows)
    say(f"\nTargets at RTT {TARGET_RTT:g} ms (medians over steps; the median of {n_runs} run{'s' * (n_runs > 1)}):")
    if not targets:
        say(f"  none measured (run with an RTT of {TARGET_RTT:g} ms)")
    for t in targets:
        digits = 0 if t["unit"] else 3
        runs = ", ".join(f"{v:.{digits}f}" for v in t["per_run"])
        say(f"  {t['name']:72s} {t['value']:9.{digits}f} {'<' if t['strict'] else '<='} {t['limit']:g}  "
            f"(runs {runs})  {'PASS' if t['pass'] else 'FAIL'}")
    for case, values in controls(runs_rows).items():
        say(f"  (the floor on this machine for {CASES[case]}: the local code idle one RTT a read gives "
            f"{statistics.median(values):.3f}, runs {', '.join(f'{v:.3f}' for v in values)}; not a target)")
        beyond = [(mine["remote_ms"] - mine["local_ms"] - echo, ctl["remote_ms"] - ctl["local_ms"] - TARGET_RTT)
                  for run, echo in zip(runs_rows, echo_ms or [])
                  if (mine := _row(run, case, REMOTORCH, TARGET_RTT)) and (ctl := _row(run, case, CONTROL, TARGET_RTT))]
        if beyond:
            say(f"  (what that case costs beyond the round trip, ms per {'token' if case == 'generate' else 'step'}, "
                f"runs: remotorch's remote - local - a bare round trip (echo) through the same proxy "
                f"{', '.join(f'{b:.2f}' for b, _ in beyond)}; the control's remote - local - {TARGET_RTT:g} ms "
                f"{', '.join(f'{c:.2f}' for _, c in beyond)})")

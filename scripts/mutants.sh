#!/usr/bin/env bash
# Mutation testing (mutmut 3, the `dev` extra) of the modules whose promises are subtle, each group
# against the tests that cover it. Outside CI: it takes long. docs/testing.md keeps its report.
#
#   bash scripts/mutants.sh [GROUP...]        (default: every group, one after the other)
#
# Groups: rng, policy, replay, tenants, holding (see SPECS below). Each runs in its own copy of
# the checkout, mutants/GROUP/ (mutmut makes mutants/GROUP/mutants/ inside it), with the
# [tool.mutmut] table of pyproject.toml narrowed to that group's modules and tests. It prints,
# per module: mutants, killed, survived, timed out, no tests, other, and the share killed of
# those not listed as equivalent in scripts/mutants.equivalent ("NAME  why", one a line); then
# every survivor not listed there, and every listed one that no longer survives.
#
# MUTANTS_CHILDREN: mutants run at once (default 1: a shared machine); MUTANTS_NICE: the niceness
# (default 15); MUTANTS_REPORT_ONLY=1: print the last run's table again; MUTANTS_ISOLATION: mutmut's process_isolation, "fork" (default: each mutant forks from
# the process that ran the tests once, torch on one thread) or "forkserver". A group's copy is made afresh on each run (rm -rf mutants/GROUP to drop it).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
py="${PYTHON:-python3}"
mutmut="$(dirname "$(command -v "$py")")/mutmut"
[[ -x "$mutmut" ]] || mutmut="$(command -v mutmut || true)"
[[ -n "$mutmut" ]] || { echo "mutmut not found: pip install -e '.[dev]'" >&2; exit 2; }

# group: modules (under src/remotorch) | tests (in-process ones: mutmut counts which tests reach a
# function in the pytest process only, so a worker subprocess's code needs tests that run it here)
declare -A SPECS=(
    [rng]="worker/rng.py client/rng.py|tests/unit/test_worker_rng.py tests/unit/test_client_rng.py tests/unit/test_rngstate.py"
    [policy]="client/policy.py client/depth.py|tests/unit/test_read_policy.py tests/unit/test_step_pipe.py"
    [replay]="worker/replay.py|tests/unit/test_replays.py"
    [tenants]="worker/tenancy.py worker/tenants.py|tests/unit/test_tokens_file.py tests/unit/test_tenancy.py"
    [holding]="transport/holding.py|tests/unit/test_holding.py"
)
ORDER=(rng policy replay tenants holding)
groups=("$@")
[[ ${#groups[@]} -gt 0 ]] || groups=("${ORDER[@]}")

copy_checkout() {  # the tracked files (and the compiled framing, if built) into $1
    rm -rf "$1"
    mkdir -p "$1"
    git ls-files -z | tar --null -T - -cf - | tar -xf - -C "$1"
    cp src/remotorch/transport/*.so "$1/src/remotorch/transport/" 2>/dev/null || true
}

narrow_config() {  # pyproject.toml in $1: [tool.mutmut] for modules $2, tests $3
    "$py" - "$1/pyproject.toml" "$2" "$3" "${MUTANTS_ISOLATION:-fork}" <<'EOF'
import re, sys
path, modules, tests = sys.argv[1], sys.argv[2].split(), sys.argv[3].split()
text = open(path, encoding="utf-8").read()
text = re.sub(r"\n\[tool\.mutmut\]\n(?:(?!\n\[).)*", "\n", text, flags=re.S)
quoted = lambda items: "[" + ", ".join(f'"{i}"' for i in items) + "]"
text += ("\n[tool.mutmut]\nsource_paths = [\"src\"]\n"
         f"only_mutate = {quoted('src/remotorch/' + m for m in modules)}\n"
         f"pytest_add_cli_args_test_selection = {quoted(tests)}\n"
         "pytest_add_cli_args = [\"-p\", \"no:cacheprovider\"]\n"
         f"process_isolation = \"{sys.argv[4]}\"\n"
         "timeout_constant = 2.0\n")
open(path, "w", encoding="utf-8").write(text)
EOF
}

report() {  # $1: the group's copy; $2: its modules
    (cd "$1" && "$mutmut" results --all true) > "$1/results.txt" 2>&1 || true
    "$py" - "$1/results.txt" "$repo/scripts/mutants.equivalent" $2 <<'EOF'
import collections, re, sys
results, equivalent_path, modules = sys.argv[1], sys.argv[2], sys.argv[3:]
status = {}
for line in open(results, encoding="utf-8"):
    found = re.match(r"\s*(remotorch\.\S+): (.+)$", line)
    if found:
        status[found.group(1)] = found.group(2).strip()
equivalent = {}
for line in open(equivalent_path, encoding="utf-8"):
    if line.strip() and not line.startswith("#"):
        name, _, why = line.strip().partition(" ")
        equivalent[name] = why.strip()
print(f"| module | mutants | killed | survived | timed out | no tests | other | equivalent | killed of the rest |")
print("|---|---|---|---|---|---|---|---|---|")
unlisted, stale = [], []
for module in modules:
    dotted = "remotorch." + module[:-3].replace("/", ".") + "."
    mine = {k: v for k, v in status.items() if k.startswith(dotted)}
    counts = collections.Counter(mine.values())
    eq = [k for k, v in mine.items() if v == "survived" and k in equivalent]
    stale += [k for k in equivalent if k.startswith(dotted) and mine.get(k) != "survived"]
    unlisted += [k for k, v in mine.items() if v == "survived" and k not in equivalent]
    killed, timeout = counts["killed"], counts["timeout"]
    other = len(mine) - killed - counts["survived"] - timeout - counts["no tests"]
    rest = len(mine) - len(eq)
    share = f"{100 * (killed + timeout) / rest:.1f}%" if rest else "-"
    print(f"| {module} | {len(mine)} | {killed} | {counts['survived']} | {timeout} | {counts['no tests']} | "
          f"{other} | {len(eq)} | {share} |")
for name in unlisted:
    print("survived, not listed as equivalent:", name)
for name in stale:
    print("listed as equivalent, no longer survives:", name)
EOF
}

for group in "${groups[@]}"; do
    spec="${SPECS[$group]:?unknown group $group (one of: ${ORDER[*]})}"
    modules="${spec%%|*}"
    tests="${spec#*|}"
    work="$repo/mutants/$group"
    echo "== $group: $modules ($tests)"
    if [[ "${MUTANTS_REPORT_ONLY:-0}" == 0 ]]; then  # 1: the table of the last run again (equivalents re-read)
        copy_checkout "$work"
        narrow_config "$work" "$modules" "$tests"
        # one thread for torch: a forked mutant must not inherit an OpenMP pool (and the tests are tiny)
        (cd "$work" && env -u PYTHONPATH OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 nice -n "${MUTANTS_NICE:-15}" \
            "$mutmut" run --max-children "${MUTANTS_CHILDREN:-1}" > "$work/run.log" 2>&1) \
            || echo "mutmut run exited $? (see $work/run.log)"
    fi
    report "$work" "$modules"
done

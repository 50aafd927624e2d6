#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite; extra arguments go to pytest.
#   bash scripts/test.sh            every test
#   bash scripts/test.sh -q -x      pytest options pass through
# pytest's exit code 5 ("no tests collected") is turned into a failure: a run
# that tested nothing must not pass.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh
status=0
"$REMOTORCH_PY" -m pytest "$@" || status=$?
if [[ $status -eq 5 ]]; then
    echo "test.sh: pytest collected no tests (exit 5); treating that as a failure" >&2
    exit 1
fi
exit "$status"

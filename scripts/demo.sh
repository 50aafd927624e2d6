#!/usr/bin/env bash
# Set up (if needed) and run the remotorch demo: example models through a real
# loopback worker, checked against local eager and timed.
#   bash scripts/demo.sh [remotorch demo options, e.g. --engine inductor --repeats 20]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh
exec "$REMOTORCH_PY" -m remotorch demo "$@"

#!/usr/bin/env bash
# remotorch on a CUDA machine, end to end, in one run (its longest part is the targets: each
# inductor row compiles GPT-2 124M on both sides; --targets and --dtypes choose the rows):
#
#   bash scripts/gpu-check.sh [OUT] [--device cpu] [--quick] [--parts P,P] [--targets S,S] [--dtypes D,D]
#
#   1. set-up: an interpreter whose torch sees a CUDA device: $PYTHON, else python3
#      when its torch does, else a virtualenv (.venv-gpu) with the CUDA build of
#      torch==2.13.0 from the package index; remotorch's own requirements from the
#      wheels in $REMOTORCH_WHEELS (a machine with no index) or from the index;
#      remotorch itself from this checkout (PYTHONPATH=src; the compiled framing is
#      built in place where a compiler and libcrypto are there, else the Python one);
#      the engines' CUDA packages, onnxruntime-gpu and torch-tensorrt, from the index
#      where they are not there yet and can be installed (the log says which could not);
#   2. pytest -m gpu: the tests marked gpu, against real `remotorch serve --device cuda`;
#   3. benchmarks/gpu_check.py: each engine on CUDA, DataParallel on two workers
#      sharing the GPU, the targets (GPT-2 124M remote / local, eager and inductor,
#      float32 and bfloat16, forward and training step, worker memory against local),
#      remote_profile with CUDA events.
#
# Everything lands in OUT (default: a new temporary folder): setup.log, pytest-gpu.log
# (+ .xml), gpu_check.log, gpu_check.md (the tables docs/gpu.md takes), gpu_check.json,
# the workers' logs. Exit status: 0 when every part passed, 1 otherwise, 2 when set-up failed.
# --device cpu --quick checks the script itself on a machine without a GPU: any
# interpreter ($PYTHON, else python3), no engine packages, no pytest (unless
# REMOTORCH_GPU_CHECK_TESTS=1), every benchmark part small.
# REMOTORCH_GPU_CHECK_TESTS=0 skips step 2 (a rerun of benchmark parts).
# REMOTORCH_GPU_CHECK_ARGS: more arguments for gpu_check.py.
set -uo pipefail
out=""
device=cuda
passed=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --device) device="${2:?--device takes cpu or cuda}"; passed+=(--device "$2"); shift 2 ;;
        --device=*) device="${1#--device=}"; passed+=(--device "$device"); shift ;;
        --quick) passed+=(--quick); shift ;;
        --parts|--targets|--dtypes) passed+=("$1" "${2:?$1 takes a list}"); shift 2 ;;
        -h|--help) sed -n '2,30p' "${BASH_SOURCE[0]}"; exit 0 ;;
        -*) echo "gpu-check: unknown option $1" >&2; exit 2 ;;
        *) out="$1"; shift ;;
    esac
done
[[ -n "$out" ]] || out="$(mktemp -d)/gpu-check"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
cd "$repo"
export PYTHONUNBUFFERED=1

cuda_python() { "$1" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; }

{
    py="${PYTHON:-}"
    if [[ -z "$py" ]] && { [[ "$device" == cpu ]] || cuda_python python3; }; then
        py="$(command -v python3)"
    fi
    if [[ -z "$py" ]]; then
        echo "setup: no interpreter with a CUDA torch: a virtualenv with torch==2.13.0 from the index"
        python3 -m venv "$repo/.venv-gpu" && py="$repo/.venv-gpu/bin/python" \
            && "$py" -m pip install -q "torch==2.13.0" || exit 2
    fi
    site="$(mktemp -d)/site"
    missing=$("$py" - <<'EOF'
import importlib.util
need = ["msgspec", "numpy", "cryptography", "rich", "transformers", "pytest", "sybil"]
print(" ".join(n for n in need if importlib.util.find_spec(n) is None))
EOF
)
    if [[ -n "$missing" ]]; then
        if [[ -n "${REMOTORCH_WHEELS:-}" ]]; then
            echo "setup: $missing from the wheels in $REMOTORCH_WHEELS"
            "$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$REMOTORCH_WHEELS"/*.whl || exit 2
        else
            echo "setup: $missing from the index"
            "$py" -m pip install -q --target "$site" $missing || exit 2
        fi
    fi
    export PYTHONPATH="$site:$repo/src${PYTHONPATH:+:$PYTHONPATH}"
    if [[ "$device" != cpu ]]; then  # the engines' CUDA packages, where the index has them
        if "$py" -c 'import onnxruntime, sys; sys.exit("CUDAExecutionProvider" not in onnxruntime.get_available_providers())' 2>/dev/null; then
            echo "setup: onnxruntime with its CUDA provider is there"
        elif "$py" -m pip install -q --target "$site" onnxruntime-gpu >/dev/null 2>&1; then
            echo "setup: onnxruntime-gpu installed from the index"
        else
            echo "setup: onnxruntime-gpu could not be installed (no index, or no wheel for this Python): onnxrt runs only where its CPU provider does"
        fi
        tv="$("$py" -c 'import torch; print(torch.__version__.split("+")[0])')"
        if "$py" -c 'import torch_tensorrt' 2>/dev/null; then
            echo "setup: torch-tensorrt is there"
        elif "$py" -m pip install -q --target "$site" "torch-tensorrt==$tv" >/dev/null 2>&1; then
            echo "setup: torch-tensorrt $tv installed from the index"
        else
            echo "setup: torch-tensorrt $tv could not be installed (no index, or no release for this torch): the tensorrt engine is not offered"
        fi
    fi
    ( "$py" setup.py -q build_ext --inplace >/dev/null 2>&1 && echo "setup: compiled framing built" ) \
        || echo "setup: compiled framing not built (no compiler or libcrypto headers): the Python framing"
    "$py" -c 'import torch, remotorch; print("setup: torch", torch.__version__, "CUDA", torch.version.cuda,
torch.cuda.get_device_name(0) if torch.cuda.is_available() else "(no CUDA device)")' || exit 2
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/setup: /'
    echo "$py" > "$out/.python"
    echo "$PYTHONPATH" > "$out/.pythonpath"
} 2>&1 | tee "$out/setup.log"
status=${PIPESTATUS[0]}
[[ $status -eq 0 ]] || exit 2
py="$(cat "$out/.python")"
export PYTHONPATH="$(cat "$out/.pythonpath")"

tests=0
default_tests=1
[[ "$device" == cpu ]] && default_tests=0  # nothing marked gpu runs without one: keep the check of the script quick
if [[ "${REMOTORCH_GPU_CHECK_TESTS:-$default_tests}" != 0 ]]; then  # 0: the benchmark parts alone (a rerun)
    "$py" -m pytest -m gpu tests/integration/test_gpu.py tests/integration/test_training_gpu.py \
        tests/integration/test_gpu_parity.py -q -p no:cacheprovider \
        --junitxml "$out/pytest-gpu.xml" 2>&1 | tee "$out/pytest-gpu.log"
    tests=${PIPESTATUS[0]}
fi

"$py" benchmarks/gpu_check.py "$out" ${passed[@]+"${passed[@]}"} ${REMOTORCH_GPU_CHECK_ARGS:-} 2>&1 | tee "$out/gpu_check.log"
check=${PIPESTATUS[0]}
echo "gpu-check: pytest -m gpu exit $tests; gpu_check.py exit $check"
[[ $tests -eq 0 && $check -eq 0 ]]

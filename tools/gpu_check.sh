#!/usr/bin/env bash
# Ragged paged attention on an NVIDIA GPU, compiled (not interpreted): the kernel tests, then the
# benchmark, then the KV pool sized from the GPU's memory under load, then a summary table.
# Then LoRA's dense and ragged deltas (DENSE_MAX_COLUMNS in jaxserve/models/layers/lora.py).
# Finishes within 9 minutes (each step has its own timeout).
#
# Setup, once, from the repo root:   pip install -e '.[cuda,test]'    (jax[cuda13])
# Run, from the repo root:           tools/gpu_check.sh
# PYTHON=... picks the interpreter (default: .venv/bin/python if present, else python3).
#
# JAXSERVE_PALLAS_INTERPRET=0 makes tests/test_ragged_paged_attention.py run the GPU variant
# compiled on the default backend; its interpret-only tests (dense numpy check, export
# lowerings) skip.
set -u -o pipefail

cd "$(dirname "$0")/.." || exit 1
if [[ -n "${PYTHON:-}" ]]; then
    PY="$PYTHON"
elif [[ -x .venv/bin/python ]]; then
    PY=.venv/bin/python
else
    PY=python3
fi
LOG_DIR="$(mktemp -d)"
declare -a SUMMARY=()

run_step() {  # name, timeout seconds, command...
    local name="$1" limit="$2"
    shift 2
    local start=$SECONDS
    echo "=== $name (timeout ${limit}s)"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$LOG_DIR/$name.log"
    local status=${PIPESTATUS[0]}
    local verdict=ok
    if (( status == 124 || status == 137 )); then verdict="TIMEOUT"; elif (( status != 0 )); then verdict="FAILED ($status)"; fi
    SUMMARY+=("$(printf '%-10s %-12s %4ds' "$name" "$verdict" $((SECONDS - start)))")
    return "$status"
}

run_step devices 60 "$PY" -c '
import jax
print("jax", jax.__version__, "backend", jax.default_backend(), jax.devices())
assert jax.default_backend() == "gpu", "no GPU backend: install jax[cuda13] (pip install -e .[cuda,test])"
' || { echo "no GPU backend; stopping"; exit 1; }

JAXSERVE_PALLAS_INTERPRET=0 run_step tests 150 "$PY" -m pytest -q -p no:cacheprovider \
    tests/test_ragged_paged_attention.py -rs
run_step bench 110 "$PY" tools/bench_kernels.py --runs 10
run_step memory 150 "$PY" tools/bench_memory.py --device --utilization 0.5 --num-requests 32
run_step lora 60 "$PY" tools/bench_lora.py --repeat 20 --slots 2 5 17 33 --tokens 1 64 512

echo
echo "=== summary"
printf '%-10s %-12s %5s\n' step result time
printf '%s\n' "${SUMMARY[@]}"
tests_line=$(grep -E '(passed|failed|error)' "$LOG_DIR/tests.log" | tail -n 1)
echo "tests: ${tests_line:-no result}"
echo "bench: kernel vs reference per shape (ms, GB/s, share of copy bandwidth)"
grep -E '^(decode|prefill|mixed)|^  (kernel|reference|jax ops decode) ' "$LOG_DIR/bench.log" || true
echo "memory: KV pool sized by --gpu-memory-utilization 0.5, peak bytes in use against the budget"
grep -E 'KV pool:|share|^ +0\.' "$LOG_DIR/memory.log" || true
echo "lora: dense vs ragged delta (ms)"
grep -E '^ +[0-9]+ +[0-9]+ ' "$LOG_DIR/lora.log" || true
! printf '%s\n' "${SUMMARY[@]}" | grep -qE 'FAILED|TIMEOUT'

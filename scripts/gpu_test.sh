#!/usr/bin/env bash
# `make gpu-test`: on a machine with a CUDA GPU, the whole pytest suite (its GPU-only cases run
# there), then compute-sanitizer's memcheck over scripts/gpu/sanitize_all.py (every kernel once,
# small odd shapes). Writes a short dated log, results/gpu-test/<date>-<gpu-slug>.log: the GPU and
# versions, pytest's summary, failures and slowest cases, the sanitizer's error summary and one
# line per kernel. Exits non-zero if either stage failed.
#
#   PYTHON=python3 scripts/gpu_test.sh [pytest arguments: test paths replace tests/, options add]
#   SANITIZE_SKIP="sgemm_ladder" skips steps of sanitize_all.py (a quick run; not for the record);
#   SANITIZE_ONLY="moe_fwd_bwd" runs only the named steps
#   GPU_TEST_STAGES="pytest" (or "sanitize") runs one stage, for jobs with a time limit: on an H100
#   the suite takes about 19 minutes in one process; the sanitizer took 150 s on 2026-12-07
#   GPU_TEST_PYTEST_LIMIT=SECONDS stops the suite after that long and still writes the log
#   GPU_TEST_WORKERS=8 (the default where pytest-xdist is installed; 1 turns it off) runs the suite
#   in that many processes sharing the GPU, each test file in one process: 251 s on an H100 on
#   2026-12-07, with the extensions already built (a first build adds minutes). No test asserts a
#   speed, and the one that times a slow call spins the GPU, which sharing it cannot shorten.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
SANITIZER=${SANITIZER:-compute-sanitizer}
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg
# Debug mode: launchers also check tensor values (block ids, lengths, barrier timeouts).
export GPU_BRRR_DEBUG=1

if ! slug=$($PYTHON -c "from kernels import device; assert device.GPU_MODE; print(device.gpu_slug())" 2>/dev/null); then
    echo "gpu-test: needs a CUDA GPU and \$PYTHON ($PYTHON) with a CUDA build of torch" >&2
    exit 2
fi
mkdir -p results/gpu-test
stages=${GPU_TEST_STAGES:-pytest sanitize}
suffix=""
[[ $stages == *pytest* && $stages != *sanitize* ]] && suffix="-pytest"
[[ $stages == *sanitize* && $stages != *pytest* ]] && suffix="-sanitize"
log="results/gpu-test/$(date -u +%F)-$slug$suffix.log"
# GPU_TEST_KEEP=DIR keeps pytest's and the sanitizer's whole output there (a run cut short by a
# time limit then still leaves what it printed).
if [[ -n ${GPU_TEST_KEEP:-} ]]; then
    work=$GPU_TEST_KEEP; mkdir -p "$work"
else
    work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
fi

paths=()
for a in "$@"; do [[ $a == tests* || $a == *.py* ]] && paths+=("$a"); done
[[ ${#paths[@]} -gt 0 ]] || set -- tests "$@"

pytest_rc=0 san_rc=0
: >"$work/pytest.txt"
: >"$work/sanitize.txt"
t0=$(date +%s)
if [[ $stages == *pytest* ]]; then
    # One line per test (-v), so a run cut short still says how far it got; with pytest-timeout
    # installed, a test that hangs fails after GPU_TEST_TIMEOUT seconds instead of stalling the run.
    opts=()
    $PYTHON -c "import pytest_timeout" 2>/dev/null && opts+=(--timeout "${GPU_TEST_TIMEOUT:-300}")
    workers=${GPU_TEST_WORKERS:-8}
    $PYTHON -c "import xdist" 2>/dev/null && [[ $workers -gt 1 ]] && opts+=(-n "$workers" --dist loadfile)
    # GPU_TEST_PYTEST_LIMIT=SECONDS interrupts the suite after that long (SIGINT: pytest stops
    # and prints its summary), so that a run under a time limit still writes its log.
    limit=()
    [[ ${GPU_TEST_PYTEST_LIMIT:-0} -gt 0 ]] && limit=(timeout -s INT -k 30 "$GPU_TEST_PYTEST_LIMIT")
    "${limit[@]}" $PYTHON -m pytest -m "not browser" -v -p no:cacheprovider -rfE --durations=12 \
        "${opts[@]}" --junitxml="$work/junit.xml" "$@" >"$work/pytest.txt" 2>&1
    pytest_rc=$?
fi
t1=$(date +%s)
if [[ $stages == *sanitize* ]]; then
    # One cudaMalloc per tensor: PyTorch's caching allocator would hide an overrun in its pools.
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 $SANITIZER --tool memcheck --error-exitcode 3 \
        $PYTHON scripts/gpu/sanitize_all.py >"$work/sanitize.txt" 2>&1
    san_rc=$?
fi
t2=$(date +%s)

{
    echo "# make gpu-test, $(date -u '+%F %H:%M') UTC, commit $(scripts/tree_rev.sh)"
    $PYTHON -c "from kernels import device; print(device.describe())"
    echo
    if [[ $stages == *pytest* ]]; then
        echo "## pytest (exit $pytest_rc, $((t1 - t0)) s)"
        tail -n 1 "$work/pytest.txt"
        [[ $pytest_rc -eq 124 ]] && echo "cut short: GPU_TEST_PYTEST_LIMIT=$GPU_TEST_PYTEST_LIMIT s reached"
        # -v writes one line per test as it ends: what ran, even if the summary above is missing.
        echo "per-test lines: $(grep -cE ' PASSED' "$work/pytest.txt") passed," \
            "$(grep -cE ' FAILED' "$work/pytest.txt") failed, $(grep -cE ' ERROR' "$work/pytest.txt") errors"
        grep -E '^(FAILED|ERROR) ' "$work/pytest.txt" | cut -c1-240 | head -n 40
        sed -n '/slowest .* durations/,/^$/p' "$work/pytest.txt" | grep -E '^[0-9.]+s ' | head -n 12
    else
        echo "## pytest: not run (GPU_TEST_STAGES=$stages)"
    fi
    echo
    if [[ $stages == *sanitize* ]]; then
        echo "## compute-sanitizer --tool memcheck scripts/gpu/sanitize_all.py (exit $san_rc, $((t2 - t1)) s)"
        grep -E '^(ok|FAIL) |^sanitize_all:|ERROR SUMMARY' "$work/sanitize.txt" | cut -c1-240
        grep -E '^=+ (Invalid|Address|Program hit|Saved host backtrace)' "$work/sanitize.txt" | sort | uniq -c | head -n 20
    else
        echo "## compute-sanitizer: not run (GPU_TEST_STAGES=$stages)"
    fi
} >"$log"
cat "$log"
echo "gpu-test: log written to $log"
[[ $pytest_rc -eq 0 && $san_rc -eq 0 ]]

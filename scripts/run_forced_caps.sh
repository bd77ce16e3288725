#!/usr/bin/env bash
# Rehearse a T4 on any GPU: run every notebook with GPU_BRRR_FORCE_CAPS=no-bf16,no-tma,no-fp8, so
# kernels/device.py reports the capability flags of a Turing-class T4 and each notebook takes its
# fallbacks (fp16 for bf16, the plain matmul for TMA, no fp8 timings) instead of its Hopper paths.
# Every notebook must still run to the end and say what it fell back to. Writes a short dated log,
# results/gpu-test/<date>-<gpu-slug>-forced-caps-<HHMM>.log: the device block, one line per notebook
# (passed or FAILED, seconds) and the fallback lines each printed; the executed copies go to a
# temporary folder, never over the committed outputs. Exits non-zero if a notebook failed. A run that
# re-runs a few notebooks (after a fix) writes its own log: the newest result of each notebook counts.
#
#   PYTHON=python3 scripts/run_forced_caps.sh [notebooks/04b-triton-matmul.ipynb ...]
#   GPU_BRRR_FORCE_CAPS=no-tma scripts/run_forced_caps.sh      # another set of flags
#   KEEP=/tmp/forced scripts/run_forced_caps.sh                # keep the executed notebooks there
#
# Act 5's notebooks (05*) take their GPU path on two or more GPUs; on one GPU they run their workers
# with gloo on the CPU, as a one-GPU T4 on Colab would, and that fallback is what this run checks.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
export GPU_BRRR_FORCE_CAPS=${GPU_BRRR_FORCE_CAPS:-no-bf16,no-tma,no-fp8}
export PYTHONUNBUFFERED=1

if ! info=$($PYTHON -c "import torch; from kernels import device; assert device.GPU_MODE; \
print(device.gpu_slug(), torch.cuda.device_count())" 2>&1); then
    echo "run_forced_caps: needs a CUDA GPU and \$PYTHON ($PYTHON) with a CUDA build of torch:" >&2
    echo "$info" | tail -n 3 >&2
    exit 2
fi
read -r slug n_gpus <<<"$(echo "$info" | tail -n 1)"
mkdir -p results/gpu-test
log="results/gpu-test/$(date -u +%F)-$slug-forced-caps-$(date -u +%H%M).log"  # a rerun adds a log
out=${KEEP:-$(mktemp -d)}
mkdir -p "$out"
[[ -z ${KEEP:-} ]] && trap 'rm -rf "$out"' EXIT

notebooks=("$@")
if [[ ${#notebooks[@]} -eq 0 ]]; then
    notebooks=(notebooks/*.ipynb)
fi

t0=$(date +%s)
$PYTHON scripts/run_gpu_notebooks.py --no-bench --keep-going --out-dir "$out" "${notebooks[@]}" \
    >"$out/run.txt" 2>&1
rc=$?
t1=$(date +%s)

{
    echo "# scripts/run_forced_caps.sh, $(date -u '+%F %H:%M') UTC, commit $(scripts/tree_rev.sh)"
    echo "# GPU_BRRR_FORCE_CAPS=$GPU_BRRR_FORCE_CAPS, $n_gpus GPU(s), ${#notebooks[@]} notebooks, $((t1 - t0)) s, exit $rc"
    $PYTHON -c "from kernels import device; print(device.describe())"
    echo
    echo "## notebooks"
    grep -E '^executing |^  done in |^  FAILED|^failed: ' "$out/run.txt" | cut -c1-200
    echo
    echo "## results (tests/test_device.py reads these lines: each notebook's newest result must pass)"
    awk '/^executing notebooks\// { nb = $2; sub(/^notebooks\//, "", nb); sub(/\.ipynb$/, "", nb) }
         /^  done in /  { printf "#   %-32s%7s%9s\n", nb, "passed", $3 }
         /^  FAILED/    { printf "#   %-32s%7s%9s\n", nb, "FAILED", "-" }' "$out/run.txt"
    echo
    echo "## what each notebook said it fell back to (its printed lines)"
    $PYTHON - "$out" "${notebooks[@]}" <<'PY'
import json, re, sys
from pathlib import Path

out, names = Path(sys.argv[1]), sys.argv[2:]
said = re.compile(r"instead|fall|skip|no bf16|no fp8|without|needs|not measured|n/a|forced|emulat", re.I)
for name in names:
    path = out / Path(name).name
    if not path.exists():
        print(f"{Path(name).name}: not written")
        continue
    lines, error = [], None
    for cell in json.loads(path.read_text())["cells"]:
        for o in cell.get("outputs", []):
            if o.get("output_type") == "stream":
                text = "".join(o.get("text", ""))
                lines += [l.strip() for l in text.splitlines() if said.search(l)]
            elif o.get("output_type") == "error":
                error = f"{o.get('ename')}: {o.get('evalue', '')[:200]}"
    seen = list(dict.fromkeys(lines))
    print(f"{path.name}: {len(seen)} line(s)" + (f"; ERROR {error}" if error else ""))
    for l in seen[:12]:
        print(f"    {l[:200]}")
PY
    if [[ $rc -ne 0 ]]; then
        echo
        echo "## failures (the end of run_gpu_notebooks.py's output)"
        tail -n 60 "$out/run.txt" | cut -c1-240
    fi
} >"$log"
cat "$log"
echo "run_forced_caps: log written to $log"
[[ $rc -eq 0 ]]

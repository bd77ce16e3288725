#!/usr/bin/env bash
# Nsight Compute evidence for the open hypotheses of four pages (MLA decode, the MoE grouped GEMM,
# the Hopper GEMM ladder, FlashAttention on Hopper; scripts/gpu/profile_misses.py says which
# measurement settles what). Per
# topic, the driver runs once under ncu, which profiles only the launches it brackets with
# cudaProfilerStart/Stop, and once without a profiler for the plain timings. One text file per
# topic, OUTDIR/<date>-<gpu-slug>-<topic>.txt: the timings, the driver's output under ncu, ncu's
# details page, and last a per-kernel summary (duration, DRAM % and bytes, L2 hit rate, tensor
# pipes, registers, occupancy, spills, top stalls).
#
#   bash scripts/gpu/profile_misses.sh [OUTDIR] [moe] [hgemm] [mla] [fa]  (default: results/profiles; moe hgemm mla)
#
# Needs $PYTHON (python3) with a CUDA torch and `kernels` importable, ncu and nvcc on the PATH.
# Every run has its own timeout, capped by what is left of PROFILE_TOTAL_S (540 s); a run that
# fails or times out leaves what it printed and the next one runs. About 6-7 minutes on an H100
# (estimates, not yet measured): moe ~100 s, hgemm ~100 s (its two builds run in the background
# from the start, during moe), mla ~180 s (MLA, then DSA's step). mla runs last so that nothing
# else loads the CPU while it times host work.
# KEEP_REPS=1 keeps the .ncu-rep files in OUTDIR/ncu-reps (for Nsight Compute's GUI).
set -uo pipefail

OUTDIR=${1:-results/profiles}
[[ $# -gt 0 ]] && shift
TOPICS=("$@")
[[ ${#TOPICS[@]} -gt 0 ]] || TOPICS=(moe hgemm mla)
for t in "${TOPICS[@]}"; do
    [[ $t == mla || $t == moe || $t == hgemm || $t == fa ]] || { echo "unknown topic '$t' (mla, moe, hgemm, fa)" >&2; exit 2; }
done
mkdir -p "$OUTDIR" && OUTDIR=$(cd "$OUTDIR" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PYTHON=${PYTHON:-python3}
NCU=${NCU:-ncu}
DRIVER=scripts/gpu/profile_misses.py
TOTAL_S=${PROFILE_TOTAL_S:-540}
RESERVE_S=20  # kept back from the last runs for ncu's imports and the summaries
AB_DEFINE=HGEMM12_CLUSTER_RELEASE=1
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg

# Seconds each run may take (then capped by the total). The first run of a topic compiles its
# Triton kernels (about 30 s for the six tiles of mla or moe); hgemm's builds take a minute or two.
declare -A LIMIT=(
    [moe-ncu]=110 [moe-time]=70
    [hgemm-build]=200 [hgemm-ncu]=80 [hgemm-ab-ncu]=50 [hgemm-time]=45 [hgemm-ab-time]=35
    [mla-ncu]=110 [mla-time]=70 [dsa-ncu]=80 [dsa-time]=50
    [fa-ncu]=150 [fa-time]=60
)
# Kernels whose details page is printed (the summary lists every kernel); empty: all.
declare -A DETAILS=([mla]='regex:_mla_|_indexer|_sparse' [moe]='' [hgemm]='' [fa]='')
declare -A RC SEC

WORK=$(mktemp -d)
BUILD_PIDS=()
# On any exit: stop builds still running (kill reaches them through their `timeout`), clean up.
trap 'kill ${BUILD_PIDS[@]+"${BUILD_PIDS[@]}"} 2>/dev/null; rm -rf "$WORK"' EXIT

# hgemm's two builds (default, and the A/B define) start now, in the background, one nvcc each.
if [[ " ${TOPICS[*]} " == *" hgemm "* ]]; then
    timeout -k 10 "${LIMIT[hgemm-build]}" $PYTHON $DRIVER hgemm --build-only \
        >"$WORK/hgemm-build.log" 2>&1 &
    BUILD_PIDS+=($!)
    timeout -k 10 "${LIMIT[hgemm-build]}" $PYTHON $DRIVER hgemm --build-only --define $AB_DEFINE \
        >"$WORK/hgemm-build-ab.log" 2>&1 &
    BUILD_PIDS+=($!)
fi

if ! info=$($PYTHON -c "from kernels import device; assert device.GPU_MODE; print(device.gpu_slug()); print(device.describe().splitlines()[0])" 2>&1); then
    echo "profile_misses: needs a CUDA GPU and \$PYTHON ($PYTHON) that imports kernels:" >&2
    echo "$info" | tail -n 3 >&2
    exit 2
fi
SLUG=$(sed -n 1p <<<"$info")
GPU_LINE=$(sed -n 2p <<<"$info")
DATE=$(date -u +%F)

NCU_OK=1
if ! command -v "$NCU" >/dev/null; then
    echo "profile_misses: no '$NCU' on the PATH: timings only" >&2
    NCU_OK=0
fi
# --clock-control none: kernels run at the clocks the timings see (ncu's default locks them to
# base). Caches are flushed before each kernel (ncu's default), as bench.measure flushes L2.
NCU_ARGS=(--profile-from-start off --nvtx --target-processes all --clock-control none
    --launch-count 80 --force-overwrite
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats
    --section LaunchStats --section Occupancy)
METRICS=""
METRICS_NOTE=""
NCU_VERSION="no ncu"
if ((NCU_OK)); then
    NCU_VERSION=$($NCU --version 2>&1 | tail -n 1)
    # Extra metrics checked against this ncu's own list: an unknown name fails the whole run.
    METRICS=$(timeout 150 $PYTHON $DRIVER ncu-metrics --ncu "$NCU" 2>"$WORK/metrics.log")
    echo "ncu: $NCU_VERSION; $(tail -n 1 "$WORK/metrics.log")"
fi

left() { echo $((TOTAL_S - SECONDS - RESERVE_S)); }

limit_for() {  # LIMIT[tag], capped by what is left of the total
    local want=${LIMIT[$1]} l
    l=$(left)
    ((l < want)) && want=$l
    echo "$want"
}

record() {  # TAG RC START: remember a run's exit status and seconds, print a progress line
    RC[$1]=$2
    SEC[$1]=$((SECONDS - $3))
    local what="exit $2"
    [[ $2 == 124 || $2 == 137 ]] && what="TIMED OUT"
    [[ $2 == skipped ]] && what="skipped"
    echo "  $1: $what after ${SEC[$1]} s"
}

run_py() {  # TAG DRIVER-ARGS...: the driver without a profiler
    local tag=$1 lim t0=$SECONDS
    shift
    lim=$(limit_for "$tag")
    if ((lim < 10)); then
        echo "skipped: no time left" >"$WORK/$tag.log"
        record "$tag" skipped "$t0"
        return
    fi
    timeout -k 10 "$lim" $PYTHON $DRIVER "$@" >"$WORK/$tag.log" 2>&1
    record "$tag" $? "$t0"
}

run_ncu() {  # TAG DRIVER-ARGS...: the driver under ncu, the report in $WORK/TAG.ncu-rep
    local tag=$1 lim t0=$SECONDS rc metrics=()
    shift
    lim=$(limit_for "$tag")
    if ((!NCU_OK || lim < 10)); then
        echo "skipped: $( ((NCU_OK)) && echo 'no time left' || echo 'no ncu')" >"$WORK/$tag.log"
        record "$tag" skipped "$t0"
        return
    fi
    [[ -n $METRICS ]] && metrics=(--metrics "$METRICS")
    timeout -k 15 "$lim" $NCU "${NCU_ARGS[@]}" ${metrics[@]+"${metrics[@]}"} -o "$WORK/$tag" \
        $PYTHON $DRIVER "$@" >"$WORK/$tag.log" 2>&1
    rc=$?
    # A metric this ncu refuses despite the check: this run and the next with the sections only.
    if ((rc != 0)) && [[ -n $METRICS ]] && grep -qiE 'metric.*(not found|unknown|invalid|failed)|failed to find metric' "$WORK/$tag.log"; then
        echo "  $tag: ncu refused a metric ($(grep -iE -m1 'metric' "$WORK/$tag.log")); the sections only from now on"
        METRICS_NOTE="extra metrics dropped after: $(grep -iE -m1 'metric' "$WORK/$tag.log")"
        METRICS=""
        lim=$(limit_for "$tag")
        if ((lim >= 10)); then
            mv "$WORK/$tag.log" "$WORK/$tag.metrics-refused.log"
            timeout -k 15 "$lim" $NCU "${NCU_ARGS[@]}" -o "$WORK/$tag" \
                $PYTHON $DRIVER "$@" >"$WORK/$tag.log" 2>&1
            rc=$?
        fi
    fi
    record "$tag" $rc "$t0"
}

section() { printf '\n%s\n== %s\n%s\n' "$(printf '=%.0s' {1..100})" "$1" "$(printf '=%.0s' {1..100})"; }

status_of() {
    local rc=${RC[$1]:-not run}
    case $rc in
        0) echo "ok" ;;
        124 | 137) echo "timed out" ;;
        *) echo "$rc" ;;
    esac
}

write_topic() {  # TOPIC "PLAIN TAGS" "NCU TAGS": assemble OUTDIR/<date>-<slug>-<topic>.txt
    local topic=$1 plain=$2 profiled=$3 file tag rep filter status="" args=""
    # fa with FA_ARGS (other shapes) gets a file of its own: "--n 512 --batch 32" -> fa-n512-batch32
    [[ $topic == fa ]] && args=${FA_ARGS:-}
    file="$OUTDIR/$DATE-$SLUG-$topic$(sed -E 's/--([a-z]+) +/-\1/g; s/ //g' <<<"$args").txt"
    filter=${DETAILS[$topic]}
    {
        echo "# scripts/gpu/profile_misses.sh $topic, $(date -u '+%F %H:%M') UTC, commit $(scripts/tree_rev.sh)"
        echo "# $GPU_LINE; $NCU_VERSION"
        echo "# ncu ${NCU_ARGS[*]} --metrics <$(tr ',' '\n' <<<"$METRICS" | grep -c .) extra> $PYTHON $DRIVER $topic --part profile $args..."
        [[ -n $METRICS_NOTE ]] && echo "# $METRICS_NOTE"
        for tag in $plain; do
            section "$tag (no profiler): $(status_of "$tag"), ${SEC[$tag]:-?} s"
            cat "$WORK/$tag.log" 2>/dev/null
        done
        for tag in $profiled; do
            section "$tag: the driver under ncu: $(status_of "$tag"), ${SEC[$tag]:-?} s"
            grep -v '^==PROF== ' "$WORK/$tag.log" 2>/dev/null | tail -n 80
            echo "($(grep -c '^==PROF== Profiling' "$WORK/$tag.log" 2>/dev/null) kernels profiled)"
        done
        for tag in $profiled; do
            rep="$WORK/$tag.ncu-rep"
            [[ -f $rep ]] || continue
            section "$tag: Nsight Compute details page${filter:+ (kernels matching $filter)}"
            if [[ -z $filter ]] || ! timeout 120 $NCU --import "$rep" --kernel-name "$filter" \
                --print-summary none --page details 2>&1; then
                timeout 120 $NCU --import "$rep" --print-summary none --page details 2>&1
            fi
        done
        for tag in $profiled; do
            section "$tag: summary per kernel (from ncu's raw page)"
            rep="$WORK/$tag.ncu-rep"
            if [[ ! -f $rep ]]; then
                echo "no report: ncu $(status_of "$tag") (its output is above)"
                continue
            fi
            timeout 120 $NCU --import "$rep" --page raw --csv --print-units base >"$WORK/$tag.csv" 2>&1 ||
                timeout 120 $NCU --import "$rep" --page raw --csv >"$WORK/$tag.csv" 2>&1
            $PYTHON $DRIVER summarize "$WORK/$tag.csv" 2>&1
            if [[ ${KEEP_REPS:-0} == 1 ]]; then
                mkdir -p "$OUTDIR/ncu-reps" && cp "$rep" "$OUTDIR/ncu-reps/$DATE-$SLUG-$tag.ncu-rep"
            fi
        done
    } >"$file"
    for tag in $plain $profiled; do status+="$tag $(status_of "$tag") ${SEC[$tag]:-?} s, "; done
    echo "$topic: ${status%, } -> $file ($(wc -l <"$file") lines)"
}

topic_moe() {
    run_ncu moe-ncu moe --part profile
    run_py moe-time moe --part time
    write_topic moe "moe-time" "moe-ncu"
}

topic_hgemm() {
    local t0=$SECONDS ncu_tags="hgemm-ncu" plain="hgemm-build hgemm-build-ab hgemm-time"
    wait "${BUILD_PIDS[0]}"
    RC[hgemm-build]=$?
    wait "${BUILD_PIDS[1]}"
    RC[hgemm-build-ab]=$?
    SEC[hgemm-build]=$((SECONDS - t0))  # the wait here, not the whole build
    SEC[hgemm-build-ab]=${SEC[hgemm-build]}
    run_ncu hgemm-ncu hgemm --part profile
    run_py hgemm-time hgemm --part time
    if [[ ${RC[hgemm-build-ab]} == 0 ]]; then  # (a build that failed would fail again)
        run_ncu hgemm-ab-ncu hgemm --part profile --steps 11 12 --define $AB_DEFINE
        run_py hgemm-ab-time hgemm --part time --steps 11 12 --define $AB_DEFINE
        ncu_tags+=" hgemm-ab-ncu"
        plain+=" hgemm-ab-time"
    fi
    write_topic hgemm "$plain" "$ncu_tags"
}

topic_mla() {  # MLA first, then DSA's step in processes of its own (it compiles three kernels)
    run_ncu mla-ncu mla --part profile --no-dsa
    run_py mla-time mla --part time --no-dsa
    run_ncu dsa-ncu mla --part profile --only-dsa
    run_py dsa-time mla --part time --only-dsa
    write_topic mla "mla-time dsa-time" "mla-ncu dsa-ncu"
}

topic_fa() {
    # FA_ARGS="--n 512 --batch 32": the shapes sweep's short case instead of 2 x 16 x 8,192
    run_ncu fa-ncu fa --part profile ${FA_ARGS:-}
    run_py fa-time fa --part time ${FA_ARGS:-}
    write_topic fa "fa-time" "fa-ncu"
}

echo "profile_misses: ${TOPICS[*]} on $GPU_LINE -> $OUTDIR (at most $TOTAL_S s)"
for t in "${TOPICS[@]}"; do
    "topic_$t"
done
echo "profile_misses: done in $SECONDS s"

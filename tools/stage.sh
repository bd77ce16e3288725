#!/usr/bin/env bash
# Run one named stage of the build and say how long it took:  tools/stage.sh NAME COMMAND [ARG...]
# When GPU_BRRR_TIMINGS names a file, "NAME<TAB>SECONDS<TAB>ok|FAILED" is appended to it, so .ci/run
# can print one table of every stage at the end.
set -uo pipefail
name="$1"
shift
echo "=== ${name}: $*"
start=$(date +%s.%N)
"$@"
rc=$?
secs=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
status=$([[ $rc -eq 0 ]] && echo ok || echo "FAILED (exit $rc)")
echo "=== ${name}: ${status} in ${secs} s"
if [[ -n "${GPU_BRRR_TIMINGS:-}" ]]; then
    printf '%s\t%s\t%s\n' "$name" "$secs" "$status" >>"$GPU_BRRR_TIMINGS"
fi
exit $rc

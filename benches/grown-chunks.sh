#!/usr/bin/env bash
# A read's chunks grown for large reads (plan::chunk::for_read, the default)
# against the device's fixed chunk size (what the engine did before), on
# the fast drives: interleaved, REPS rounds of (grown, fixed) per drive kind
# and concurrency, each a `bench --arms engine` of RUNS runs. Root only.
#
# Usage: benches/grown-chunks.sh [OUT_FILE]
#   KINDS   default "memloop zram"     REPS  default 3     RUNS  default 3
# Prints one line per bench (median GB/s, min-max, CPU s/GB, p50 ms, and the
# chunk size the engine would use for a 19.9 MB expert) and writes them to
# OUT_FILE (default docs/benchmarks/DATE-grown-chunks/ab.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
# shellcheck source=benches/machine.sh
. benches/machine.sh   # $simdrives, cold, machine_*, write_meta
kinds=${KINDS:-memloop zram}
reps=${REPS:-3}
runs=${RUNS:-3}
out=${1:-docs/benchmarks/$(date +%F)-grown-chunks/ab.txt}
if [ "$(id -u)" != 0 ]; then echo "grown-chunks: SKIP: needs root (simdrives)"; exit 0; fi
cargo build --release --quiet
ws=$root/target/release/weightstream
export SIMDRIVES_BASE=/tmp/ws-grown-chunks
trap '"$simdrives" down >/dev/null 2>&1 || true' EXIT
"$simdrives" down >/dev/null 2>&1 || true
mkdir -p "$(dirname "$out")"
: > "$out"
for kind in $kinds; do
    mapfile -t mnts < <("$simdrives" up 1 --kind "$kind" --size 2)
    dir=${mnts[0]}/model
    "$ws" gen "$dir" --size 1GiB >/dev/null
    sync; echo 3 > /proc/sys/vm/drop_caches
    dev=$(basename "$(df --output=source "${mnts[0]}" | tail -1)")
    # The device's chunk: max_sectors_kb clamped to 1-4 MiB (the fixed arm).
    kb=$(cat "/sys/block/$dev/queue/max_sectors_kb")
    base=$(( kb < 1024 ? 1024 : (kb > 4096 ? 4096 : kb) ))
    echo "== $kind ($dev, max_sectors_kb $kb: fixed chunk ${base} KiB)" | tee -a "$out"
    for rep in $(seq "$reps"); do
        for c in 8 1; do
            for arm in grown fixed; do
                args=()
                [ "$arm" = fixed ] && args=(--chunk "${base}KiB")
                line=$("$ws" bench "$dir" --arms engine --runs "$runs" --concurrency "$c" "${args[@]}" --json 2>/dev/null |
                    python3 -c '
import json, sys
a = json.load(sys.stdin)["arms"]["engine"]
print("%.2f GB/s (%.2f-%.2f) cpu %.4f s/GB p50 %.2f ms" % (a["gbps"], a["gbps_min"], a["gbps_max"], a["cpu_s_per_gb"], a["p50_ms"]))')
                echo "$kind c$c round $rep $arm: $line" | tee -a "$out"
            done
        done
    done
    "$simdrives" down >/dev/null 2>&1 || true
done

#!/usr/bin/env bash
# Two builds of weightstream, interleaved (A B A B ...), on one capped
# simdrives drive: `bench --arms engine` with its ceiling sweep each run.
# Root only. Usage: benches/before-after.sh BEFORE_BIN AFTER_BIN OUT_DIR
#   CAP_MBPS (200), RUNS (3 per build), CONC ("8 1")
set -euo pipefail
cd "$(dirname "$0")/.."
before=$1 after=$2 out=$3
cap=${CAP_MBPS:-200} runs=${RUNS:-3} conc=${CONC:-8 1}
# shellcheck source=benches/machine.sh
. benches/machine.sh   # $simdrives, cold, machine_*, write_meta
[ "$(id -u)" = 0 ] || { echo "before-after: SKIP: needs root"; exit 0; }
export SIMDRIVES_BASE=/tmp/ws-before-after
mkdir -p "$out"
trap '"$simdrives" down >/dev/null 2>&1 || true' EXIT
"$simdrives" down >/dev/null 2>&1 || true
mapfile -t mnts < <("$simdrives" up 1 --mbps "$cap" --size 2)
"$after" gen "${mnts[0]}/model" --size 512MiB >/dev/null
sync; echo 3 > /proc/sys/vm/drop_caches
for c in $conc; do
    for r in $(seq 1 "$runs"); do
        for side in before after; do
            bin=$before; [ "$side" = after ] && bin=$after
            "$simdrives" exec "$bin" bench "${mnts[0]}/model" --arms ceiling,engine --runs 1 \
                --concurrency "$c" --json > "$out/$side-c$c-r$r.json"
        done
    done
done
python3 - "$out" <<'PY'
import glob, json, statistics, sys
out = sys.argv[1]
rows = ["| concurrency | build | engine GB/s (median, min-max) | engine / cap | CPU s/GB | p50 ms | p99 ms |", "|---|---|---|---|---|---|---|"]
for c in (8, 1):
    for side in ("before", "after"):
        runs = [json.load(open(p)) for p in sorted(glob.glob(f"{out}/{side}-c{c}-r*.json"))]
        if not runs:
            continue
        e = [r["arms"]["engine"] for r in runs]
        g = [x["gbps"] for x in e]
        rows.append(f"| {c} | {side} | {statistics.median(g):.4f} ({min(g):.4f}-{max(g):.4f}) | {statistics.median(g)/0.2:.3f} | "
                    f"{statistics.median(x['cpu_s_per_gb'] for x in e):.4f} | {statistics.median(x['p50_ms'] for x in e):.1f} | {statistics.median(x['p99_ms'] for x in e):.1f} |")
open(f"{out}/table.md", "w").write("\n".join(rows) + "\n")
print("\n".join(rows))
PY

#!/usr/bin/env bash
# The measurements under the scaling model (docs/benchmarks/DATE-scaling):
# what one load costs per GB on this machine, part by part, and a check of
# the model in the small on 1 and 4 simulated drives.
#
#   benches/scaling.sh [OUT_DIR]        (root: simdrives, drop_caches)
#
# 1. rates.json: benches/scaling/rates.c: the first touch (kernel clear) of
#    fresh memory on 2 MiB and 4 KiB pages, and memcpy between written
#    buffers, on 1 thread and on every CPU (best of 3, 2 GiB each);
# 2. one memloop drive with the reference model (benches/peers/
#    write_model.py, SIZE bytes, default 1e9):
#      ceiling.json   weightstream load-ceiling --json: fio's best and the
#                     machine's busy CPU over it (the drive's own copy: the
#                     loop worker's, which an NVMe drive's DMA does not
#                     cost)
#      1-faulted-R.json  weightstream load --memory faulted --json: the
#                     engine's own CPU per GB (ring thread and caller, into
#                     memory already faulted in), RUNS runs (default 3)
#      1-fresh-R.json weightstream load --json into fresh memory
#    each with the machine's busy CPU seconds over the run (/proc/stat)
#    kept beside it (KEY-R.busy);
# 3. the same model placed over 4 memloop drives (weightstream place
#    --layout split): 4-faulted-R.json, 4-fresh-R.json;
# Then benches/scaling-model.py OUT: OUT/model.md and OUT/model.json (the
# per-GB costs, the model's prediction for 1 and 4 drives against the
# measured loads, and the projection to 8 drives at 14 GB/s).
#
# Environment: SIZE, RUNS, WS_PEERS_VENV, KEEP_PAGE_REPORTING=1.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
# shellcheck source=benches/machine.sh
. benches/machine.sh   # $simdrives, cold, machine_*, write_meta
size=${SIZE:-1e9}
runs=${RUNS:-3}
out=${1:-docs/benchmarks/$(date +%F)-scaling}
if [ "$(id -u)" != 0 ]; then echo "scaling: SKIP: needs root (simdrives, drop_caches)"; exit 0; fi
cargo build --release --quiet -p weightstream-cli
ws=$root/target/release/weightstream
py=$(benches/peers/venv.sh)
rates=$(mktemp -d)/rates
cc -O2 -pthread -o "$rates" benches/scaling/rates.c
mkdir -p "$out"
out=$(cd "$out" && pwd)
machine_take ws-scaling-bench

write_meta "$out/meta.json" size:="$size" runs:="$runs"

echo "== rates"
"$rates" $((2 << 30)) 3 > "$out/rates.json"
python3 -c 'import json,sys; [print("  %-5s %s pages, %d thread(s): %.2f GB/s (%.2f per thread)" % (r["what"], r["pages"], r["threads"], r["gbps"], r["gbps_per_thread"])) for r in json.load(open(sys.argv[1]))["rates"]]' "$out/rates.json"

busy() { awk '/^cpu / {print $2 + $3 + $4 + $7 + $8 + $9}' /proc/stat; }
# One load: its JSON, and the machine's busy CPU seconds over it.
load() { # key run args...
    local key=$1 r=$2 b0 b1
    shift 2
    cold
    b0=$(busy)
    "$ws" load "$@" --json > "$out/$key-$r.json"
    b1=$(busy)
    python3 -c 'import sys; print((int(sys.argv[2]) - int(sys.argv[1])) / int(sys.argv[3]))' "$b0" "$b1" "$(getconf CLK_TCK)" > "$out/$key-$r.busy"
    python3 -c 'import json,sys; v=json.load(open(sys.argv[1])); b=float(open(sys.argv[2]).read()); print("  %-10s run %s: %.3f GB/s, process CPU %.3f s/GB, machine busy %.3f s/GB" % (sys.argv[3], sys.argv[4], v["gbps"], v["cpu_seconds_per_gb"], b / (v["bytes"] / 1e9)))' \
        "$out/$key-$r.json" "$out/$key-$r.busy" "$key" "$r"
}

src=/var/tmp/ws-scaling-model-$size
if [ ! -f "$src/model.safetensors.index.json" ]; then
    rm -rf "$src"
    "$py" benches/peers/write_model.py "$src" --bytes "$size"
fi

echo "== one memloop drive"
mapfile -t mnts < <("$simdrives" up 1 --kind memloop --size 4)
cp -r "$src" "${mnts[0]}/model"
sync
cold
"$ws" load "${mnts[0]}/model" > /dev/null  # warm-up
cold
b0=$(busy)
"$ws" load-ceiling "${mnts[0]}/model" --json > "$out/ceiling.json"
python3 -c 'import sys; print((int(sys.argv[2]) - int(sys.argv[1])) / int(sys.argv[3]))' "$b0" "$(busy)" "$(getconf CLK_TCK)" > "$out/ceiling.busy"
for r in $(seq 1 "$runs"); do
    load 1-faulted "$r" "${mnts[0]}/model" --memory faulted
    load 1-fresh "$r" "${mnts[0]}/model"
done
"$simdrives" down >/dev/null 2>&1 || true

echo "== four memloop drives, split"
mapfile -t mnts < <("$simdrives" up 4 --kind memloop --size 2)
to=$(IFS=';'; echo "${mnts[*]}")
primary=$("$ws" place "$src" --to "$to" --layout split --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["primary"])')
sync
cold
"$ws" load "$primary" > /dev/null  # warm-up
for r in $(seq 1 "$runs"); do
    load 4-faulted "$r" "$primary" --memory faulted
    load 4-fresh "$r" "$primary"
done
"$simdrives" down >/dev/null 2>&1 || true
python3 benches/scaling-model.py "$out"

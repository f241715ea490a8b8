#!/usr/bin/env bash
# Loads shared across ranks (weightstream.torch.load_distributed) against
# every rank reading everything, and against the Run:ai streamer's
# distributed mode, on storage capped per rank: each rank is its own
# process in its own blkio cgroup, capped at MBPS to the drive (its node's
# link to shared storage).
#
# Usage (root): benches/distributed.sh [OUT_DIR]
# Environment: ROUNDS (default 3), MBPS (per rank, default 200), SIZE
# (model bytes, default 0.8e9), WORLDS (default "1 2 4"), KIND (memloop),
# ARMS (default "ws-dist ws-share gloo-floor ws-each runai-dist"), WS_PEERS_VENV.
#
# Per round, cold cache, interleaved: ws-dist, ws-share (each rank reads
# its share alone, no exchange) and gloo-floor (the exchange alone, no
# reads) with each world size (the two floors from 2 ranks); ws-each and
# runai-dist with the largest. The table judges ws-dist against the larger
# of the two floors of its round (issue 38: at most 1.15x), and the
# busiest rank's bytes against 1/N of the model plus its largest tensor. Each run's time is its ranks' (a barrier
# before and after: the slowest rank, to a full state dict on every rank).
# Writes OUT/runs.jsonl (one line per rank per run), OUT/table.md and
# OUT/time.svg (median seconds per arm and world).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
# shellcheck source=benches/machine.sh
. benches/machine.sh   # $simdrives, cold, machine_*, write_meta
rounds=${ROUNDS:-3}
mbps=${MBPS:-200}
size=${SIZE:-0.8e9}
kind=${KIND:-memloop}
read -r -a worlds <<< "${WORLDS:-1 2 4}"
read -r -a arms <<< "${ARMS:-ws-dist ws-share gloo-floor ws-each runai-dist}"
out=${1:-docs/benchmarks/$(date +%F)-distributed}
if [ "$(id -u)" != 0 ]; then echo "distributed: SKIP: needs root (simdrives, cgroups, drop_caches)"; exit 0; fi
[ -d /sys/fs/cgroup/blkio ] || { echo "distributed: needs the cgroup v1 blkio controller" >&2; exit 1; }
py=$(benches/peers/venv.sh)
CARGO_TARGET_DIR=$root/target "$py" -m pip install --quiet --force-reinstall --no-deps ./python
mkdir -p "$out"
out=$(cd "$out" && pwd)
: > "$out/runs.jsonl"
export SIMDRIVES_BASE=/tmp/ws-dist-bench SIMDRIVES_CGROUP=ws-dist-bench
machine_save
max=${worlds[-1]}
cgroups=()
cleanup() {
    for cg in "${cgroups[@]}"; do
        [ -d "$cg" ] && { cat "$cg/cgroup.procs" 2>/dev/null | while read -r p; do echo "$p" > /sys/fs/cgroup/blkio/cgroup.procs; done; rmdir "$cg" 2>/dev/null || true; }
    done
    [ -f "$SIMDRIVES_BASE/drives" ] && "$simdrives" down >/dev/null 2>&1
    machine_restore
}
trap cleanup EXIT
machine_quiet

mapfile -t mnts < <("$simdrives" up 1 --kind "$kind" --size 4)
dir=${mnts[0]}/model
"$py" benches/peers/write_model.py "$dir" --bytes "$size"
sync
dev=$(findmnt -no SOURCE "${mnts[0]}")
mm=$(lsblk -dno MAJ:MIN "$dev" | tr -d ' ')
# One cgroup per rank, each capped at MBPS on the drive.
for r in $(seq 0 $((max - 1))); do
    cg=/sys/fs/cgroup/blkio/ws-dist-rank$r
    mkdir -p "$cg"
    echo "$mm $((mbps * 1000000))" > "$cg/blkio.throttle.read_bps_device"
    cgroups+=("$cg")
done
echo "== $kind drive $dev ($mm), model $(du -sh "$dir" | cut -f1), $mbps MB/s per rank"

sizes=$("$py" -c 'import sys, weightstream; s = [c[3] for c in weightstream._native.catalog(sys.argv[1])]; print(sum(s), max(s))' "$dir")
write_meta "$out/meta.json" kind="$kind" mbps_per_rank:="$mbps" size:="$size" model_bytes:="${sizes% *}" \
    largest_tensor_bytes:="${sizes#* }" rounds:="$rounds" worlds@="${worlds[*]}" arms@="${arms[*]}"

run() { # arm world round
    local arm=$1 w=$2 r=$3 init pids=() rc=0
    init=$(mktemp -u /tmp/ws-dist-init.XXXXXX)
    cold
    for k in $(seq 0 $((w - 1))); do
        "$py" benches/dist/rank.py "$arm" "$dir" "$init" "$k" "$w" "$out/$arm-$w-$r-$k.json" "${cgroups[$k]}" \
            2> "$out/$arm-$w-$r-$k.err" &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || rc=$?; done
    rm -f "$init"
    if [ "$rc" != 0 ]; then
        echo "  round $r $arm x$w FAILED (rc $rc): $(tail -n 2 "$out/$arm-$w-$r-0.err" | tr '\n' ' ')"
        return 0
    fi
    for k in $(seq 0 $((w - 1))); do
        python3 -c 'import json,sys; v=json.load(open(sys.argv[1])); v["round"]=int(sys.argv[2]); print(json.dumps(v))' \
            "$out/$arm-$w-$r-$k.json" "$r" >> "$out/runs.jsonl"
        [ -s "$out/$arm-$w-$r-$k.err" ] || rm -f "$out/$arm-$w-$r-$k.err"
        rm -f "$out/$arm-$w-$r-$k.json"
    done
    python3 -c 'import json,sys; v=[json.loads(l) for l in open(sys.argv[1]) if l.strip()][-int(sys.argv[2]):]; print("  round %s %-10s x%s %7.3f s  (%.3f GB/s a rank)" % (sys.argv[3], v[0]["arm"], sys.argv[2], max(x["seconds"] for x in v), v[0]["bytes"]/max(x["seconds"] for x in v)/1e9))' "$out/runs.jsonl" "$w" "$r"
}

for r in $(seq 1 "$rounds"); do
    for arm in "${arms[@]}"; do
        case $arm in
            ws-dist|ws-share|gloo-floor) for w in "${worlds[@]}"; do [ "$arm" != ws-dist ] && [ "$w" = 1 ] && continue; run "$arm" "$w" "$r"; done ;;
            *) run "$arm" "$max" "$r" ;;
        esac
    done
done
"$py" benches/dist/table.py "$out"

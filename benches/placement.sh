#!/usr/bin/env bash
# Placement record (issue 13): `weightstream place` against the write
# ceiling of the same drives, the page cache it leaves, and the read
# speed-up each layout (mirror, split, layers) gives on two capped drives
# over one drive.
#
# Two loop drives from simdrives (../shared/tools/simdrives). simdrives caps
# READS only (blkio throttle.read_bps_device / io.max rbps); this script
# adds the same cap on WRITES (throttle.write_bps_device / wbps) for the
# capped write phase. A blkio write cap throttles O_DIRECT writes (what
# `place` and `fio --direct=1` issue); buffered writes are written back
# outside the cgroup under cgroup v1, so `cp` is not a capped baseline here.
#
# Root only; skips with a message otherwise.
# Usage: benches/placement.sh [OUT_DIR]
#   CAP_MBPS   per-drive cap, MB/s (10^6 B/s)        default 200
#   MODEL_SIZE synthetic model                       default 1GiB
#   RUNS       runs per read arm (bench medians)      default 3
#   SIMDRIVES  the simdrives tool                    default ../shared/tools/simdrives
#   SKIP_WRITE set: skip the write phase
# Writes OUT_DIR/placement.json and OUT_DIR/*.log (default docs/benchmarks/DATE-placement).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
# shellcheck source=benches/machine.sh
. benches/machine.sh   # $simdrives, cold, machine_*, write_meta
cap=${CAP_MBPS:-200}
size=${MODEL_SIZE:-1GiB}
runs=${RUNS:-3}
date=$(date +%F)
out=${1:-docs/benchmarks/$date-placement}

if [ "$(id -u)" != 0 ]; then echo "placement: SKIP: needs root (simdrives)"; exit 0; fi
if [ ! -x "$simdrives" ]; then echo "placement: SKIP: no simdrives at $simdrives"; exit 0; fi

cargo build --release --quiet
ws=$root/target/release/weightstream
mkdir -p "$out"
out=$(cd "$out" && pwd)
json=$out/placement.json
"$simdrives" down >/dev/null 2>&1 || true
work=$(mktemp -d "$root/target/placement-bench.XXXX")
cleanup() { "$simdrives" down >/dev/null 2>&1 || true; rm -rf "$work"; rmdir /sys/fs/cgroup/memory/wsplace 2>/dev/null || true; }
trap cleanup EXIT

src=$work/model
"$ws" gen "$src" --size "$size" --layers 8 --expert-bytes 4MiB --shards 4 | tee "$out/gen.log"
echo '{"cap_mbps": '"$cap"', "model_size": "'"$size"'", "runs": '"$runs"', "write": [], "read": []}' > "$json"

wcap() { # dev mbps: cap (or uncap with 0) O_DIRECT writes of drive dev
    local mm cg=/sys/fs/cgroup/blkio/simdrives
    [ -d "$cg" ] || cg=/sys/fs/cgroup/simdrives
    mm=$(lsblk -dno MAJ:MIN "$1" | tr -d ' ')
    if [ -f "$cg/blkio.throttle.write_bps_device" ]; then
        echo "$mm $(( $2 * 1000000 ))" > "$cg/blkio.throttle.write_bps_device"
    elif [ "$2" = 0 ]; then echo "$mm wbps=max" > "$cg/io.max"
    else echo "$mm wbps=$(( $2 * 1000000 ))" > "$cg/io.max"; fi
}
add() { # section json-object
    python3 - "$json" "$1" "$2" <<'PY'
import json, sys
p, k, v = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
d = json.load(open(p)); d[k].append(v); json.dump(d, open(p, "w"), indent=1)
PY
}
fio_write() { # label mount...: fio sequential O_DIRECT writes, one job per drive, all at once
    local label=$1; shift
    local args=()
    for m in "$@"; do args+=(--name="w$m" --filename="$m/fio.bin"); done
    local f
    f=$("$simdrives" exec fio --ioengine=psync --direct=1 --rw=write --bs=8M --size=768M --end_fsync=1 \
        --group_reporting --output-format=json "${args[@]}")
    rm -f "${@/%//fio.bin}"
    python3 - "$label" "$f" "$#" <<'PY'
import json, sys
label, f, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
j = f["jobs"][0]; w = j["write"]
print(json.dumps({"arm": "fio", "label": label, "drives": n, "gbps": w["bw_bytes"] / 1e9, "bytes": w["io_bytes"]}))
PY
}
place_run() { # label layout roots...
    local label=$1 layout=$2; shift 2
    local to; to=$(IFS=';'; echo "$*")
    for r in "$@"; do rm -rf "$r"; mkdir -p "$r"; done
    sync; echo 3 > /proc/sys/vm/drop_caches
    # The page cache charged to the placing process alone: its own memory
    # cgroup (v1 memory.stat `cache`), before and after. /proc/meminfo's
    # Cached (in the report) counts every process on the machine.
    local memcg=/sys/fs/cgroup/memory/wsplace c0=0 c1=0 r
    mkdir -p "$memcg" 2>/dev/null || true
    [ -f "$memcg/memory.stat" ] && c0=$(awk '$1 == "cache" {print $2}' "$memcg/memory.stat")
    r=$(sh -c 'echo $$ > "$1/cgroup.procs" 2>/dev/null; shift; exec "$@"' sh "$memcg" \
        "$simdrives" exec "$ws" place "$src" --to "$to" --layout "$layout" --json)
    [ -f "$memcg/memory.stat" ] && c1=$(awk '$1 == "cache" {print $2}' "$memcg/memory.stat")
    local res=0
    for d in "$@"; do
        res=$(( res + $(fincore --bytes --raw --noheadings --output RES "$d"/*/*.safetensors | awk '{s += $1} END {print s + 0}') ))
    done
    python3 - "$label" "$layout" "$r" "$res" "$c0" "$c1" <<'PY'
import json, sys
label, layout, r, res = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
c0, c1 = int(sys.argv[5]), int(sys.argv[6])
print(json.dumps({"arm": "place", "label": label, "layout": layout, "drives": len(r["roots"]),
                  "gbps": r["write_gbps"], "bytes": r["bytes_written"], "seconds": r["write_seconds"],
                  "cache_growth_bytes": r["cache_growth_bytes"], "memcg_cache_growth_bytes": c1 - c0,
                  "placed_resident_bytes": res}))
PY
}

mapfile -t mnts < <("$simdrives" up 2 --mbps "$cap" --size 4)
devs=()
while read -r _ dev _ _; do devs+=("$dev"); done < <("$simdrives" status | tail -n +2 | awk '{print $1, $2, $3, $4}')
m0=${mnts[0]}; m1=${mnts[1]}

# Write phase: capped (reads and writes at $cap), then uncapped.
for phase in $([ -n "${SKIP_WRITE:-}" ] || echo "$cap" 0); do
    for d in "${devs[@]}"; do wcap "$d" "$phase"; done
    for k in 0 1; do "$simdrives" throttle "$k" "$phase" >/dev/null; done
    for r in $(seq "$runs"); do
        add write "$(fio_write "cap$phase-one" "$m0")"
        add write "$(fio_write "cap$phase-two" "$m0" "$m1")"
        add write "$(place_run "cap$phase-one" mirror "$m0/w")"
        for layout in mirror split layers; do
            add write "$(place_run "cap$phase-two" "$layout" "$m0/w" "$m1/w")"
        done
    done
    rm -rf "$m0/w" "$m1/w"
done
for d in "${devs[@]}"; do wcap "$d" 0; done
for k in 0 1; do "$simdrives" throttle "$k" "$cap" >/dev/null; done

# Read phase: one drive (a plain copy) against each layout on two drives,
# reads capped at $cap, writes not.
mkdir -p "$m0/one"
"$ws" place "$src" --to "$m0/one" --layout mirror >/dev/null
for layout in mirror split layers; do
    mkdir -p "$m0/$layout" "$m1/$layout"
    "$ws" place "$src" --to "$m0/$layout;$m1/$layout" --layout "$layout" >/dev/null
done
primary() { dirname "$(ls -d "$1"/*/weightstream-layout.json)"; }
for conc in 1 8; do
    for r in $(seq "$runs"); do
        for label in one mirror split layers; do
            p=$(primary "$m0/$label")
            b=$("$simdrives" exec "$ws" bench "$p" --arms engine --runs 1 --concurrency "$conc" --json)
            python3 - "$json" "$label" "$conc" "$b" <<'PY'
import json, sys
p, label, conc, b = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
e = dict(b["arms"])["engine"]
d = json.load(open(p)); d["read"].append({"label": label, "concurrency": conc, "gbps": e["gbps"],
    "cache_growth_bytes": e.get("cache_growth_bytes")}); json.dump(d, open(p, "w"), indent=1)
PY
        done
    done
done
"$simdrives" down >/dev/null

# Layer streaming (a trainer's read: one layer at a time, read-ahead N + 1).
cargo test --release --quiet -p weightstream --test place_stripe -- --ignored --nocapture 2>&1 | tee "$out/stripe.log" | grep -E "placed|run |median" || true

python3 - "$json" <<'PY' | tee "$out/summary.txt"
import json, statistics, sys
d = json.load(open(sys.argv[1]))
med = lambda xs: statistics.median(xs) if xs else float("nan")
print(f"cap {d['cap_mbps']} MB/s per drive, model {d['model_size']}, {d['runs']} runs, medians")
print("write phase (GB/s):")
for cap in sorted({w["label"].split("-")[0] for w in d["write"]}):
    for label in (f"{cap}-one", f"{cap}-two"):
        fio = med([w["gbps"] for w in d["write"] if w["label"] == label and w["arm"] == "fio"])
        for layout in ("mirror", "split", "layers"):
            xs = [w for w in d["write"] if w["label"] == label and w["arm"] == "place" and w["layout"] == layout]
            if not xs:
                continue
            g = med([x["gbps"] for x in xs])
            cg = med([x["cache_growth_bytes"] for x in xs]) / 1e6
            mc = max(x["memcg_cache_growth_bytes"] for x in xs) / 1e6
            res = max(x["placed_resident_bytes"] for x in xs)
            print(f"  {label:>12} {layout:>6}: place {g:.3f}  fio {fio:.3f}  ratio {g / fio:.2f}  "
                  f"own page cache (memcg) max {mc:+.2f} MB  machine Cached {cg:+.1f} MB  "
                  f"placed files resident {res} B")
print("read phase, engine GB/s (bench, seeded random expert order):")
for conc in (1, 8):
    one = med([r["gbps"] for r in d["read"] if r["label"] == "one" and r["concurrency"] == conc])
    for label in ("one", "mirror", "split", "layers"):
        g = med([r["gbps"] for r in d["read"] if r["label"] == label and r["concurrency"] == conc])
        print(f"  c{conc} {label:>6}: {g:.3f}  ({g / one:.2f}x one drive)")
PY

#!/usr/bin/env bash
# Many-drive record: proven mirrors, split layouts, routing policies and a
# mid-run throttle, on ../shared/tools/simdrives capped drives. Every figure
# is a ratio to the sum of the caps and to the ceiling measured in the same
# run. Root only (loop devices, mounts, cgroups); skips with a message
# otherwise.
#
# Usage: benches/mirrors.sh [OUT_DIR]
#   CAP_MBPS    per-drive cap (MB/s, 10^6 B/s)   default 200
#   MODEL_SIZE  model size                        default 1GiB
#   RUNS        interleaved runs per arm          default 3
#   SIMDRIVES   the simdrives tool                default ../shared/tools/simdrives
# Writes OUT_DIR/*.json and OUT_DIR/mirrors.md (default docs/benchmarks/DATE-mirrors).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
simdrives=${SIMDRIVES:-$root/../shared/tools/simdrives}
cap=${CAP_MBPS:-200}
size=${MODEL_SIZE:-1GiB}
runs=${RUNS:-3}
date=$(date +%F)
out=${1:-docs/benchmarks/$date-mirrors}

if [ "$(id -u)" != 0 ]; then echo "mirrors: SKIP: needs root (simdrives makes loop devices and cgroups)"; exit 0; fi
if [ ! -x "$simdrives" ]; then echo "mirrors: SKIP: no simdrives at $simdrives"; exit 0; fi
cargo build --release --quiet
ws=$root/target/release/weightstream
mkdir -p "$out"
cleanup() { "$simdrives" down >/dev/null 2>&1 || true; }
trap cleanup EXIT
cleanup

# up N CAPS: N drives; model on drive 0, full copies on the others.
up() {
    mapfile -t mnts < <("$simdrives" up "$1" --mbps "$2" --size 3)
    "$ws" gen "${mnts[0]}/model" --size "$size" --layers 4 --shards 4 >/dev/null
    mirrors=""
    for m in "${mnts[@]:1}"; do
        mkdir -p "$m/model"
        cp "${mnts[0]}"/model/*.safetensors "$m/model/"
        mirrors="${mirrors:+$mirrors;}$m/model"
    done
    sync; echo 3 > /proc/sys/vm/drop_caches
}
bench() { # name, then bench args
    local name=$1; shift
    echo "== $name"
    "$simdrives" exec "$ws" bench "${mnts[0]}/model" --runs "$runs" --json "$@" > "$out/$name.json"
}
arms=ceiling,engine-hash,engine-stripe,engine-adaptive

for n in 1 2 4; do
    up "$n" "$cap"
    m=()
    [ -n "$mirrors" ] && m=(--mirror "$mirrors")
    bench "mirror$n-c8" --arms "$arms" --concurrency 8 "${m[@]}"
    bench "mirror$n-c1" --arms "$arms" --concurrency 1 "${m[@]}"
    if [ "$n" = 2 ]; then
        # Split: half the shards moved to drive 1, no mirror.
        mkdir -p "${mnts[1]}/split"
        rm -f "${mnts[1]}"/model/*.safetensors
        mv "${mnts[0]}"/model/model-0000[34]-of-*.safetensors "${mnts[1]}/split/"
        bench "split2-c8" --arms ceiling,engine --concurrency 8 --dirs "${mnts[1]}/split"
    fi
    cleanup
done

# Unequal drives, no weights given: adaptive should find the split itself.
up 2 "100,300"
bench "unequal-c8" --arms ceiling,engine-hash,engine-stripe,engine-adaptive --concurrency 8 --mirror "$mirrors"
cleanup

# A drive throttled mid-run: 300 + 300, then drive 1 falls to 50 after 3 s.
up 2 "300,300"
( sleep 3; "$simdrives" throttle 1 50 ) &
"$simdrives" exec "$ws" bench "${mnts[0]}/model" --runs 1 --arms engine-adaptive --concurrency 8 --passes 3 \
    --timeline-ms 100 --mirror "$mirrors" --json > "$out/throttle.json"
wait
cleanup

python3 - "$out" "$cap" "$size" "$runs" "$date" <<'PY'
import json, os, sys
out, cap, size, runs, date = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
L = [f"# Many drives: mirrors, split, routing, throttle ({date})", "",
     f"`benches/mirrors.sh` with `CAP_MBPS={cap:.0f} MODEL_SIZE={size} RUNS={runs}` on simdrives (loop-backed ext4, blkio caps).",
     "GB = 10^9 bytes; medians of interleaved runs; `sum` is the sum of the drives' caps.", ""]
def load(name):
    p = os.path.join(out, name + ".json")
    return json.load(open(p)) if os.path.exists(p) else None
single = {}
for conc in (8, 1):
    L += [f"## Full mirror, concurrency {conc}", "",
          "| drives | sum GB/s | ceiling | hash | stripe | adaptive | adaptive / sum | stripe x single | adaptive x single |", "|---|---|---|---|---|---|---|---|---|"]
    for n in (1, 2, 4):
        r = load(f"mirror{n}-c{conc}")
        if not r: continue
        a = r["arms"]; s = n * cap / 1000
        if n == 1: single[conc] = a["engine-adaptive"]["gbps"]
        base = single.get(conc, 0) or 1e-9
        L.append(f"| {n} | {s:.3f} | {r['ceiling_gbps']:.3f} | {a['engine-hash']['gbps']:.3f} | {a['engine-stripe']['gbps']:.3f} | {a['engine-adaptive']['gbps']:.3f} | {a['engine-adaptive']['gbps']/s:.3f} | {a['engine-stripe']['gbps']/base:.2f} | {a['engine-adaptive']['gbps']/base:.2f} |")
    L.append("")
r = load("split2-c8")
if r:
    s = 2 * cap / 1000
    L += ["## Split layout, two drives, concurrency 8", "", f"engine {r['arms']['engine']['gbps']:.3f} GB/s = {r['arms']['engine']['gbps']/s:.3f} x the sum ({s:.3f}); ceiling {r['ceiling_gbps']:.3f}.", ""]
r = load("unequal-c8")
if r:
    a = r["arms"]
    L += ["## Unequal drives (100 + 300 MB/s), no weights, concurrency 8", "", "| arm | GB/s | / 0.400 | drive shares |", "|---|---|---|---|"]
    for k in ("engine-hash", "engine-stripe", "engine-adaptive"):
        sh = a[k]["runs"][0].get("drives") or []
        L.append(f"| {k} | {a[k]['gbps']:.3f} | {a[k]['gbps']/0.4:.3f} | {', '.join(f'{d[0]} {d[2]:.2f}' for d in sh)} |")
    L.append("")
r = load("throttle")
if r:
    run = r["arms"]["engine-adaptive"]["runs"][0]
    tl = run.get("timeline") or []
    rows, prev = [], (0.0, [0] * len(tl[0][1]) if tl else [])
    for t, b in tl:
        dt = t - prev[0]
        rate = [(x - y) / dt / 1e9 for x, y in zip(b, prev[1])]
        rows.append((t, rate)); prev = (t, b)
    after = [(t, sum(rt)) for t, rt in rows if t > 3.0]
    target = 0.9 * 0.350
    # First time after the throttle from which a 0.5 s moving average stays >= 90% of the new sum.
    follow = None
    for i, (t, _) in enumerate(after):
        win = [v for tt, v in after if t <= tt < t + 0.5]
        if win and sum(win) / len(win) >= target:
            follow = t - 3.0; break
    L += ["## Drive 1 throttled from 300 to 50 MB/s at t = 3 s (adaptive, concurrency 8)", "",
          f"New sum 0.350 GB/s; followed (0.5 s average >= 90% of it) {('%.1f s after the throttle' % follow) if follow is not None else 'not within the run'}.", "",
          "| t (s) | drive 0 GB/s | drive 1 GB/s | total |", "|---|---|---|---|"]
    for t, rt in rows[::5]:
        L.append(f"| {t:.1f} | " + " | ".join(f"{x:.3f}" for x in rt) + f" | {sum(rt):.3f} |")
    L.append("")
open(os.path.join(out, "mirrors.md"), "w").write("\n".join(L))
print("\n".join(L))
PY

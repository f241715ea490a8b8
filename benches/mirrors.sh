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
#   STEPS       which parts run                   default "mirror unequal throttle"
#               (the record is written from every JSON present in OUT_DIR)
# Writes OUT_DIR/*.json and OUT_DIR/mirrors.md (default docs/benchmarks/DATE-mirrors).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
# shellcheck source=benches/machine.sh
. benches/machine.sh   # $simdrives, cold, machine_*, write_meta
cap=${CAP_MBPS:-200}
size=${MODEL_SIZE:-1GiB}
runs=${RUNS:-3}
date=$(date +%F)
out=${1:-docs/benchmarks/$date-mirrors}
steps=${STEPS:-mirror unequal throttle}
want() { [[ " $steps " == *" $1 "* ]]; }

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
    want mirror || break
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
if want unequal; then
    up 2 "100,300"
    bench "unequal-c8" --arms ceiling,engine-hash,engine-stripe,engine-adaptive --concurrency 8 --mirror "$mirrors"
    cleanup
fi

# A drive throttled mid-run: 300 + 300, then drive 1 falls to 50 MB/s. The
# bench measures its ceiling first, so the throttle comes a few seconds into
# the engine's run; its wall-clock time is recorded and lined up with the
# timeline's start.
if want throttle; then
    up 2 "300,300"
    ( sleep 7; "$simdrives" throttle 1 50; date +%s.%N > "$out/throttle.at" ) &
    "$simdrives" exec "$ws" bench "${mnts[0]}/model" --runs 1 --arms engine-adaptive --concurrency 8 --passes 4 \
        --timeline-ms 100 --mirror "$mirrors" --json > "$out/throttle.json"
    wait
    cleanup
fi

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
    at_file = os.path.join(out, "throttle.at")
    t_thr = float(open(at_file).read()) - run["timeline_start_unix"] if os.path.exists(at_file) else 3.0
    rows, prev = [], (0.0, [0] * len(tl[0][1]) if tl else [])
    for t, b in tl:
        dt = t - prev[0]
        rate = [(x - y) / dt / 1e9 for x, y in zip(b, prev[1])]
        rows.append((t, rate)); prev = (t, b)
    import bisect
    pts = [(t, sum(b)) for t, b in tl]
    ts = [p[0] for p in pts]
    def rate(a, b):
        i = min(bisect.bisect_left(ts, a), len(pts) - 1); j = min(bisect.bisect_left(ts, b), len(pts) - 1)
        return (pts[j][1] - pts[i][1]) / max(pts[j][0] - pts[i][0], 1e-9) / 1e9
    end = ts[-1] if ts else 0.0
    before = [rate(1.0, t_thr)]
    # Followed: the first 1 s window, starting k x 0.25 s after the throttle,
    # whose mean is >= 90% of the new sum (0.350 GB/s).
    follow = None
    k = 0
    while t_thr + k * 0.25 + 1.0 < end:
        if rate(t_thr + k * 0.25, t_thr + k * 0.25 + 1.0) >= 0.9 * 0.350:
            follow = k * 0.25; break
        k += 1
    after_rate = rate(t_thr + 1.0, end - 0.2)
    L += [f"## Drive 1 throttled from 300 to 50 MB/s at t = {t_thr:.1f} s (adaptive, concurrency 8)", "",
          f"Before: {before[0]:.3f} GB/s (sum of caps 0.600). After: the new sum is 0.350 GB/s; the first 1 s window averaging >= 90% of it starts {('%.2f s after the throttle' % follow) if follow is not None else 'never, within the run'}; from 1 s after the throttle to the end the engine read {after_rate:.3f} GB/s ({after_rate/0.35:.2f} x the new sum).", "",
          "Samples every 0.1 s (the cgroup throttle is bursty at that scale; every third shown):", "",
          "| t (s) | drive 0 GB/s | drive 1 GB/s | total |", "|---|---|---|---|"]
    for t, rt in rows[::3]:
        L.append(f"| {t:.1f} | " + " | ".join(f"{x:.3f}" for x in rt) + f" | {sum(rt):.3f} |")
    L.append("")
# Plot: GB/s against drives, per policy, beside the ideal line (N x cap).
series = []
for k in ("engine-adaptive", "engine-stripe", "engine-hash"):
    pts = [[n, load(f"mirror{n}-c8")["arms"][k]["gbps"]] for n in (1, 2, 4) if load(f"mirror{n}-c8")]
    if pts: series.append({"name": k + " c8", "points": pts})
pts = [[n, load(f"mirror{n}-c1")["arms"]["engine-adaptive"]["gbps"]] for n in (1, 2, 4) if load(f"mirror{n}-c1")]
if pts: series.append({"name": "engine-adaptive c1", "points": pts})
series.append({"name": "ideal (N x cap)", "points": [[n, n * cap / 1000] for n in (1, 2, 4)]})
spec = {"title": f"full mirror on N drives capped at {cap:.0f} MB/s, median of {runs}", "xlabel": "drives", "ylabel": "GB/s", "series": series}
json.dump(spec, open(os.path.join(out, "plot.json"), "w"))
import subprocess
subprocess.run([os.environ.get("WS", "target/release/weightstream"), "plot", os.path.join(out, "plot.json"), os.path.join(out, "mirrors.svg")], check=True)
L.insert(5, "![GB/s against drives](mirrors.svg)\n")
open(os.path.join(out, "mirrors.md"), "w").write("\n".join(L))
print("\n".join(L))
PY

#!/usr/bin/env bash
# Multi-drive record: N independent capped "drives" (../shared/tools/simdrives:
# loop-backed filesystems, each with its own read-bandwidth cap), the device
# ceiling on 1, 2 and 4 of them read at once against the ideal line (N x cap),
# and the engine's bench on one drive, all in the same run.
# Root only (loop devices, mounts, cgroups); skips with a message otherwise.
#
# Usage: benches/multidrive.sh [OUT_DIR]
#   CAP_MBPS   per-drive read cap, MB/s (10^6 B/s)          default 200
#   MODEL_SIZE model written on each drive                  default 1GiB
#   RUNS       interleaved runs per arm                     default 3
#   SIMDRIVES  path of the simdrives tool                   default ../shared/tools/simdrives
# Writes OUT_DIR/multidrive.{md,json,svg} (default docs/benchmarks/DATE-multidrive).
# Mirrors and split layouts join the record when the engine has them.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
# shellcheck source=benches/machine.sh
. benches/machine.sh   # $simdrives, cold, machine_*, write_meta
cap=${CAP_MBPS:-200}
size=${MODEL_SIZE:-1GiB}
runs=${RUNS:-3}
date=$(date +%F)
out=${1:-docs/benchmarks/$date-multidrive}

if [ "$(id -u)" != 0 ]; then echo "multidrive: SKIP: needs root (simdrives makes loop devices and cgroups)"; exit 0; fi
if [ ! -x "$simdrives" ]; then echo "multidrive: SKIP: no simdrives at $simdrives"; exit 0; fi

cargo build --release --quiet
ws=$root/target/release/weightstream
mkdir -p "$out"
json=$out/multidrive.json
echo '{"cap_mbps": '"$cap"', "ceiling": [], "fio": [], "bench": []}' > "$json"
cleanup() { "$simdrives" down >/dev/null 2>&1 || true; }
trap cleanup EXIT
cleanup

for n in 1 2 4; do
    echo "== $n drive(s), cap $cap MB/s each"
    mapfile -t mnts < <("$simdrives" up "$n" --mbps "$cap" --size 3)
    files=()
    for m in "${mnts[@]}"; do
        "$ws" gen "$m/model" --size "$size" --layers 4 --shards 2 >/dev/null
        files+=("$m"/model/*.safetensors)
    done
    sync; echo 3 > /proc/sys/vm/drop_caches
    for r in $(seq "$runs"); do
        if [ "$n" = 1 ] && command -v fio >/dev/null; then
            # fio's same job on the same files, interleaved with the ceiling.
            f=$("$simdrives" exec fio --name=ceiling --ioengine=io_uring --direct=1 --rw=read --bs=1M --iodepth=16 \
                --readonly --file_service_type=sequential --filename="$(IFS=:; echo "${files[*]}")" --output-format=json)
            python3 - "$json" "$f" <<'PY'
import json, sys
p, f = sys.argv[1], json.loads(sys.argv[2])
j = f["jobs"][0]; rt = j["job_runtime"] / 1000; gb = j["read"]["io_bytes"] / 1e9
d = json.load(open(p)); d["fio"].append({"gbps": gb / rt, "cpu_s_per_gb": (j["usr_cpu"] + j["sys_cpu"]) / 100 * rt / gb}); json.dump(d, open(p, "w"), indent=1)
PY
        fi
        c=$("$simdrives" exec "$ws" ceiling --quick --json "${files[@]}")
        python3 - "$json" "$n" "$c" <<'PY'
import json, sys
p, n, c = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
d = json.load(open(p)); d["ceiling"].append({"drives": n, "gbps": c["gbps"], "per_drive": [x["gbps"] for x in c["drives"]], "cpu_seconds": c["cpu_seconds"], "bytes": c["bytes"]}); json.dump(d, open(p, "w"), indent=1)
PY
    done
    if [ "$n" = 1 ]; then
        for conc in 8 1; do
            b=$("$simdrives" exec "$ws" bench "${mnts[0]}/model" --arms ceiling,engine,pread,buffered,mmap --runs "$runs" --concurrency "$conc" --json)
            python3 - "$json" "$n" "$conc" "$b" <<'PY'
import json, sys
p, n, conc, b = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
d = json.load(open(p)); d["bench"].append({"drives": n, "concurrency": conc, "report": b}); json.dump(d, open(p, "w"), indent=1)
PY
        done
    fi
    "$simdrives" down >/dev/null
done

python3 - "$json" "$out" "$cap" "$size" "$runs" "$date" <<'PY'
import json, sys, statistics, subprocess, os
p, out, cap, size, runs, date = sys.argv[1:]
d = json.load(open(p)); cap = float(cap)
by = {}
for c in d["ceiling"]:
    by.setdefault(c["drives"], []).append(c["gbps"])
ns = sorted(by)
spec = {"title": f"ceiling across capped drives ({cap:.0f} MB/s each), median of {runs}", "xlabel": "drives", "ylabel": "GB/s",
        "series": [{"name": "measured", "points": [[n, statistics.median(by[n])] for n in ns]},
                   {"name": "ideal (N x cap)", "points": [[n, n * cap / 1000] for n in ns]}]}
json.dump(spec, open(os.path.join(out, "plot.json"), "w"))
subprocess.run([os.environ.get("WS", "target/release/weightstream"), "plot", os.path.join(out, "plot.json"), os.path.join(out, "multidrive.svg")], check=True)
lines = [f"# Multi-drive record, {date}", "",
         f"`benches/multidrive.sh` with `CAP_MBPS={cap:.0f} MODEL_SIZE={size} RUNS={runs}`: simdrives loop-backed ext4 drives,",
         "each capped by the blkio/io cgroup; every figure is the median of the interleaved runs; GB = 10^9 bytes.", "",
         "| drives | ideal GB/s | ceiling GB/s (median) | min-max | ratio to ideal |", "|---|---|---|---|---|"]
for n in ns:
    v = by[n]; m = statistics.median(v); ideal = n * cap / 1000
    lines.append(f"| {n} | {ideal:.3f} | {m:.3f} | {min(v):.3f}-{max(v):.3f} | {m/ideal:.3f} |")
lines += ["", "![ceiling against drives](multidrive.svg)", ""]
if d.get("fio"):
    fg = [x["gbps"] for x in d["fio"]]; fc = [x["cpu_s_per_gb"] for x in d["fio"]]
    one = [c for c in d["ceiling"] if c["drives"] == 1]
    cg = [c["gbps"] for c in one]; cc = [c["cpu_seconds"] / (c["bytes"] / 1e9) for c in one]
    lines += ["fio on the same files, interleaved with the ceiling on one drive (`fio --ioengine=io_uring --direct=1 --rw=read --bs=1M --iodepth=16 --file_service_type=sequential`):", "",
              "| reader | GB/s median | min-max | CPU s/GB median |", "|---|---|---|---|",
              f"| fio | {statistics.median(fg):.3f} | {min(fg):.3f}-{max(fg):.3f} | {statistics.median(fc):.4f} |",
              f"| weightstream ceiling | {statistics.median(cg):.3f} | {min(cg):.3f}-{max(cg):.3f} | {statistics.median(cc):.4f} |",
              f"| ratio | {statistics.median(cg)/statistics.median(fg):.3f} | | {statistics.median(cc)/statistics.median(fc):.2f} |", ""]
for b in d["bench"]:
    r = b["report"]
    lines += [f"Engine on one drive, concurrency {b['concurrency']}: ceiling {r['ceiling_gbps']:.3f} GB/s", "",
              "| arm | GB/s | ratio | CPU s/GB | p50 ms | p99 ms | page cache growth MB |", "|---|---|---|---|---|---|---|"]
    for name, a in r["arms"].items():
        f = lambda x: "-" if x is None else f"{x:.2f}"
        lines.append(f"| {name} | {a['gbps']:.3f} | {a['ratio']:.3f} | {a['cpu_s_per_gb']:.3f} | {f(a['p50_ms'])} | {f(a['p99_ms'])} | {a['cache_growth_bytes']/1e6:.0f} |")
    lines.append("")
open(os.path.join(out, "multidrive.md"), "w").write("\n".join(lines))
print("\n".join(lines))
PY

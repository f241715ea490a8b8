#!/usr/bin/env bash
# Whole-model load into process memory (issue 12's targets): weightstream's
# load_all against fio's best on the same files and against the loaders it
# replaces, cold cache, interleaved, median of RUNS, with peak RSS, page-cache
# growth and CPU per GB.
#
#   benches/load.sh [OUT_DIR]        (root: simdrives, drop_caches, hugetlb)
#
# Arms, each in a fresh process after `drop_caches`, in this order per run:
#   fio            weightstream bench --arms fio: fio's best over its sweep
#                  (queue depth, jobs, --force_async, --fixedbufs) on the
#                  model's shards; run before and after the loads, best kept
#   weightstream   weightstream load (the default: the mapping is neither
#                  populated nor registered; with a CPU to spare beside the
#                  I/O threads a helper thread faults it in ahead of the
#                  reads, else each page is faulted by the read landing in it)
#   ahead-on, ahead-off   the same with --fault-ahead on / off
#   populate       weightstream load --populate (the mapping faulted in first,
#                  then read): its mapping time is the rate at which this
#                  machine hands a process fresh memory, the other bound on
#                  any load into process memory (fio reads into the same
#                  buffers again and again and never pays it)
#   prefault       weightstream load --populate --register (the arena made
#                  first, as before this issue: map, fault, register, read)
#   safetensors-mmap  memmap2 + the safetensors crate + to_vec per tensor
#   fs-read        std::fs::read per shard, tensors borrowed
#   mmap           mapped and touched, nothing copied (pages stay in the
#                  page cache: not engine memory)
#
# KINDS: zram (one fast drive, reads complete inline), virtio (the VM's disk,
# noisy: the host caches its image). SIZE: the model (default 1900MiB).
# Writes OUT_DIR/<kind>-<arm>-<run>.json, OUT_DIR/summary.json, table.md and
# two charts per kind (GB/s with fio's best as the reference line; peak RSS
# with the model's bytes as the reference line).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
simdrives=${SIMDRIVES:-$root/../shared/tools/simdrives}
[ -x "$simdrives" ] || simdrives=$root/ci/simdrives
kinds=${KINDS:-zram virtio}
runs=${RUNS:-5}
size=${SIZE:-1900MiB}
out=${1:-docs/benchmarks/$(date +%F)-load}

if [ "$(id -u)" != 0 ]; then echo "load: SKIP: needs root (simdrives, drop_caches, hugetlb pool)"; exit 0; fi
command -v fio >/dev/null || { echo "load: needs fio (ci/install-deps installs it)"; exit 1; }
cargo build --release --quiet -p weightstream-cli
ws=$root/target/release/weightstream
mkdir -p "$out"
export SIMDRIVES_BASE=/tmp/ws-load-bench

old_huge=$(cat /proc/sys/vm/nr_hugepages)
cleanup() {
    "$simdrives" down >/dev/null 2>&1 || true
    echo "$old_huge" > /proc/sys/vm/nr_hugepages
}
trap cleanup EXIT
cleanup
echo 640 > /proc/sys/vm/nr_hugepages

cold() { sync; echo 3 > /proc/sys/vm/drop_caches; }

for kind in $kinds; do
    case $kind in
        virtio)
            mkdir -p target/tmp
            dir=$root/target/tmp/load-model-$size
            [ -d "$dir" ] || "$ws" gen "$dir" --size "$size" >/dev/null
            ;;
        zram)
            mapfile -t mnts < <("$simdrives" up 1 --kind zram --size 4)
            dir=${mnts[0]}/model
            "$ws" gen "$dir" --size "$size" >/dev/null
            ;;
        *) echo "unknown kind $kind" >&2; exit 2 ;;
    esac
    echo "== $kind: $(du -sh "$dir" | cut -f1) in $dir"
    # Warm-up, discarded: the first touch of memory this VM gave back to its
    # host costs several times more than later ones (clear_page 91% of a
    # 4 s CPU profile, against 0.1 s when warm).
    cold; "$ws" load "$dir" > /dev/null
    for r in $(seq 1 "$runs"); do
        cold
        [ "$r" = 1 ] && "$ws" bench "$dir" --arms fio --runs 1 --sweep quick --json > "$out/$kind-fio-0.json"
        for arm in weightstream ahead-on ahead-off populate prefault safetensors-mmap fs-read mmap; do
            case $arm in
                weightstream) a=(--method weightstream) ;;
                ahead-on) a=(--method weightstream --fault-ahead on) ;;
                ahead-off) a=(--method weightstream --fault-ahead off) ;;
                populate) a=(--method weightstream --populate) ;;
                prefault) a=(--method weightstream --populate --register) ;;
                *) a=(--method "$arm") ;;
            esac
            cold
            "$ws" load "$dir" "${a[@]}" --json > "$out/$kind-$arm-$r.json"
            python3 -c "
import json,sys; v=json.load(open('$out/$kind-$arm-$r.json'))
print(f\"  run $r {'$arm':17} {v['gbps']:6.3f} GB/s  {v['seconds']:6.3f} s  RSS {v['peak_rss_bytes']/v['bytes']:.3f}x  cache {v['page_cache_growth_bytes']/1e6:+8.1f} MB  CPU {v['cpu_seconds_per_gb']:.3f} s/GB\")"
        done
    done
    cold
    "$ws" bench "$dir" --arms fio --runs 1 --sweep quick --json > "$out/$kind-fio-1.json"
    [ "$kind" = zram ] && "$simdrives" down >/dev/null
done

python3 - "$out" "$kinds" "$runs" "$ws" <<'PY'
import json, statistics, subprocess, sys
out, kinds, runs, ws = sys.argv[1], sys.argv[2].split(), int(sys.argv[3]), sys.argv[4]
arms = ["weightstream", "ahead-on", "ahead-off", "populate", "prefault", "safetensors-mmap", "fs-read", "mmap"]
summary, lines = {}, []
lines.append("| drive | arm | GB/s (median) | runs | x fio best | x fio-then-fault | x safetensors-mmap | total s | mapping s | peak RSS / model | page cache growth MB | CPU s/GB |")
lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
for kind in kinds:
    fio = max(json.load(open(f"{out}/{kind}-fio-{i}.json"))["arms"]["fio"]["gbps"] for i in (0, 1))
    per = {}
    for arm in arms:
        rs = [json.load(open(f"{out}/{kind}-{arm}-{r}.json")) for r in range(1, runs + 1)]
        med = lambda f: statistics.median(f(v) for v in rs)
        per[arm] = {
            "gbps": med(lambda v: v["gbps"]),
            "seconds": med(lambda v: v["seconds"]),
            "arena_seconds": med(lambda v: (v.get("report") or {}).get("arena_seconds", 0.0)),
            "rss_ratio": med(lambda v: v["peak_rss_bytes"] / v["bytes"]),
            "cache_mb": med(lambda v: v["page_cache_growth_bytes"] / 1e6),
            "cpu_per_gb": med(lambda v: v["cpu_seconds_per_gb"]),
            "bytes": rs[0]["bytes"],
            "runs_gbps": [v["gbps"] for v in rs],
        }
    st = per["safetensors-mmap"]["seconds"]
    # Fresh memory: bytes faulted in per second (the populate arm's mapping).
    fault = per["populate"]["bytes"] / 1e9 / max(per["populate"]["arena_seconds"], 1e-9)
    # Reading at fio's best and faulting at `fault`, one after the other
    # (what a load into fresh memory costs when no CPU is spare to overlap
    # them); min(fio, fault) would be the bound with perfect overlap.
    serial = 1 / (1 / fio + 1 / fault)
    for arm in arms:
        p = per[arm]
        p["x_fio"] = p["gbps"] / fio
        p["x_serial"] = p["gbps"] / serial
        p["x_safetensors_mmap"] = st / p["seconds"]
        lines.append(
            f"| {kind} | {arm} | {p['gbps']:.3f} | {' '.join(f'{g:.2f}' for g in p['runs_gbps'])} | {p['x_fio']:.2f} | {p['x_serial']:.2f} | {p['x_safetensors_mmap']:.2f} | "
            f"{p['seconds']:.3f} | {p['arena_seconds']:.3f} | {p['rss_ratio']:.3f} | {p['cache_mb']:+.1f} | {p['cpu_per_gb']:.3f} |"
        )
    summary[kind] = {"fio_best_gbps": fio, "fault_gbps": fault, "fio_then_fault_gbps": serial, "arms": per}
    lines.append(f"| {kind} | fio best (sweep, before and after) | {fio:.3f} | | 1.00 | | | | | | | |")
    lines.append(f"| {kind} | fresh memory faulted in (populate's mapping, median) | {fault:.3f} | | | | | | | | | |")
    lines.append(f"| {kind} | fio-then-fault (1 / (1/fio + 1/fault)) | {serial:.3f} | | | 1.00 | | | | | | |")
    for what, key, unit, ref in [("gbps", "gbps", "GB/s", fio), ("rss", "rss_ratio", "peak RSS / model bytes", 1.0)]:
        spec = {
            "title": f"Whole-model load on {kind}: {'GB/s (line: fio best)' if what == 'gbps' else 'peak RSS (line: the model)'}",
            "unit": unit,
            "bars": [[a, per[a][key]] for a in arms],
            "reference": ref,
        }
        p = f"{out}/{kind}-{what}.plot.json"
        json.dump(spec, open(p, "w"))
        subprocess.run([ws, "plot", p, f"{out}/{kind}-{what}.svg"], check=True)
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
open(f"{out}/table.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY

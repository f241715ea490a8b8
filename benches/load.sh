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
# shellcheck source=benches/machine.sh
. benches/machine.sh   # $simdrives, cold, machine_*, write_meta
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

machine_save
cleanup() {
    "$simdrives" down >/dev/null 2>&1 || true
    machine_restore
}
trap cleanup EXIT
cleanup
machine_quiet

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

python3 benches/load-table.py "$out" "$kinds" "$runs" "$ws"

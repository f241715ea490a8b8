#!/usr/bin/env bash
# The engine against a true ceiling, per drive kind: every run measures the
# ceiling sweep, fio's sweep on the same files, the engine and the pread
# backend, interleaved, cold (O_DIRECT), at concurrency 8 and 1, and fio
# with the same bytes in flight as one expert (the decode case). Root only.
#
# Usage: benches/true-ceiling.sh [OUT_DIR]
#   KINDS       which drives          default "virtio zram1 zram2 memloop loop200"
#   RUNS        interleaved runs      default 3
#   SWEEP       quick | full          default quick
#   SIMDRIVES   the simdrives tool    default ../shared/tools/simdrives (else ci/simdrives)
# Writes OUT_DIR/<kind>-c<N>.json (+ .svg) and OUT_DIR/<kind>-fio-expert.json
# (default docs/benchmarks/DATE-true-ceiling). The record's tables come from
# benches/true-ceiling-table.py over those files.
#
# fio reads into huge pages (--iomem=shmhuge) when the hugetlb pool holds
# its buffers, as the ceiling and the engine's arenas do (MADV_HUGEPAGE):
# this script reserves the pool for the run (vm.nr_hugepages) and puts the
# old value back at exit.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
# shellcheck source=benches/machine.sh
. benches/machine.sh   # $simdrives, cold, machine_*, write_meta
kinds=${KINDS:-virtio zram1 zram2 memloop loop200}
runs=${RUNS:-3}
sweep=${SWEEP:-quick}
out=${1:-docs/benchmarks/$(date +%F)-true-ceiling}

if [ "$(id -u)" != 0 ]; then echo "true-ceiling: SKIP: needs root (simdrives, drop_caches, hugetlb pool)"; exit 0; fi
command -v fio >/dev/null || { echo "true-ceiling: needs fio (ci/install-deps installs it)"; exit 1; }
cargo build --release --quiet
ws=$root/target/release/weightstream
mkdir -p "$out"
export SIMDRIVES_BASE=/tmp/ws-true-ceiling

old_huge=$(cat /proc/sys/vm/nr_hugepages)
cleanup() {
    "$simdrives" down >/dev/null 2>&1 || true
    echo "$old_huge" > /proc/sys/vm/nr_hugepages
}
trap cleanup EXIT
cleanup
# fio's largest buffers: 2 drives x 2 jobs x 64 x 4 MiB, plus slack.
echo 640 > /proc/sys/vm/nr_hugepages
echo "hugetlb pool: $(grep HugePages_Free /proc/meminfo)"

model_for() { # kind -> model dir (made here), mirror list in $mirror, runner in $run
    local kind=$1 mnts
    mirror=""
    # Capped drives cap only processes in simdrives' cgroup.
    run=("$simdrives" exec)
    case $kind in
        virtio)
            run=()
            mkdir -p target/tmp
            dir=$root/target/tmp/true-ceiling-model
            [ -d "$dir" ] || "$ws" gen "$dir" --size 2GiB >/dev/null
            ;;
        zram1 | memloop)
            local k=zram; [ "$kind" = memloop ] && k=memloop
            mapfile -t mnts < <("$simdrives" up 1 --kind "$k" --size 2)
            dir=${mnts[0]}/model
            "$ws" gen "$dir" --size 1GiB >/dev/null
            ;;
        zram2)
            mapfile -t mnts < <("$simdrives" up 2 --kind zram --size 2)
            dir=${mnts[0]}/model
            "$ws" gen "$dir" --size 1GiB >/dev/null
            mkdir -p "${mnts[1]}/model"
            cp "$dir"/*.safetensors "${mnts[1]}/model/"
            mirror=${mnts[1]}/model
            ;;
        loop200)
            mapfile -t mnts < <("$simdrives" up 1 --mbps 200 --size 2)
            dir=${mnts[0]}/model
            "$ws" gen "$dir" --size 512MiB >/dev/null
            ;;
        *) echo "unknown kind $kind" >&2; exit 2 ;;
    esac
    sync
    echo 3 > /proc/sys/vm/drop_caches
}

for kind in $kinds; do
    model_for "$kind"
    m=()
    [ -n "$mirror" ] && m=(--mirror "$mirror")
    "$simdrives" status 2>/dev/null | sed 's/^/  /' || true
    "$ws" inspect "$dir" "${m[@]}" 2>/dev/null | grep -E "^drive|submit" | sed 's/^/  /' || true
    for c in 8 1; do
        echo "== $kind concurrency $c"
        "${run[@]}" "$ws" bench "$dir" "${m[@]}" --arms ceiling,fio,engine,pread --runs "$runs" \
            --sweep "$sweep" --concurrency "$c" --plot "$out/$kind-c$c.svg" --json > "$out/$kind-c$c.json"
        python3 - "$out/$kind-c$c.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
arms = r["arms"]
print("   ", "  ".join(f"{a} {v['gbps']:.3f} ({v.get('ratio_fio', 0):.2f} fio)" for a, v in arms.items()))
PY
    done
    # The decode case against fio with the same bytes in flight: one expert
    # (its mean size) in 1 MiB blocks, all at once, on every drive at once.
    expert=$(python3 -c '
import json, sys
r = json.load(open(sys.argv[1]))
print(r["bytes_per_run"] // r["tensors"])' "$out/$kind-c1.json")
    depth=$(( (expert + (1 << 20) - 1) >> 20 ))
    files=$(ls "$dir"/*.safetensors | tr '\n' ':' | sed 's/:$//; s/\\/\\\\/g')
    args=(--ioengine=io_uring --direct=1 --rw=randread --bs=1M --iodepth="$depth" --numjobs=1
          --fixedbufs=1 --iomem=shmhuge --runtime=3 --time_based --group_reporting --output-format=json
          --name=expert --filename="$files")
    if [ -n "$mirror" ]; then
        args+=(--name=mirror --filename="$(ls "$mirror"/*.safetensors | tr '\n' ':' | sed 's/:$//')")
    fi
    "${run[@]}" fio "${args[@]}" > "$out/$kind-fio-expert.json" 2>/dev/null || true
    echo "  fio, one expert in flight ($depth x 1 MiB): $(python3 -c "
import json,sys
t=open('$out/$kind-fio-expert.json').read(); d=json.loads(t[t.index('{'):])
print(round(sum(j['read']['bw_bytes'] for j in d['jobs'])/1e9,3), 'GB/s')")"
    "$simdrives" down >/dev/null 2>&1 || true
done
python3 benches/true-ceiling-table.py "$out" > "$out/table.md"
echo "wrote $out/table.md (the record's README.md quotes it)"

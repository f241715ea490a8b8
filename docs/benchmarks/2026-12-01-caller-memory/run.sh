#!/usr/bin/env bash
# The decode loop into caller memory (examples/caller_decode.rs), interleaved
# arms (crate arena, page-aligned caller buffer + placement, lent Vec +
# placement, fixed page-aligned addresses through staging), on each kind of
# simulated drive: memloop (fast, asynchronous completion, as NVMe DMA),
# zram (fast, inline completion) and a loop drive capped at 400 MB/s.
# Usage (root, from the repository root):
#   docs/benchmarks/2026-12-01-caller-memory/run.sh [STEPS] [ROUNDS] [EXPERT_BYTES] [LAYERS]
# The model (LAYERS x 16 experts x 3 projections) should be larger than the
# host's caches: a ~100 MB model read again and again on memloop or zram
# is served at cache speed (35 GB/s seen), not the drive's. fio's best over
# a sweep on a file of the model's size on the same drive is the ceiling.
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=docs/benchmarks/2026-12-01-caller-memory
steps=${1:-40}
rounds=${2:-7}
expert=${3:-1048576}
layers=${4:-8}
cargo build --release -q -p weightstream --example caller_decode
bin=target/release/examples/caller_decode
order=/sys/module/page_reporting/parameters/page_reporting_order
old_order=$(cat "$order" 2>/dev/null || echo)
[ -n "$old_order" ] && echo 11 >"$order"
export SIMDRIVES_BASE=/tmp/ws-bench-caller SIMDRIVES_CGROUP=ws-bench-caller
cleanup() {
    ci/simdrives down >/dev/null 2>&1 || true
    [ -n "$old_order" ] && echo "$old_order" >"$order"
}
trap cleanup EXIT
for kind in memloop zram loop; do
    ci/simdrives down >/dev/null 2>&1 || true
    if [ "$kind" = loop ]; then
        mnt=$(ci/simdrives up 1 --kind loop --mbps 400 --size 4)
    else
        mnt=$(ci/simdrives up 1 --kind "$kind" --size 4)
    fi
    echo "== $kind ($mnt): $steps steps x $rounds rounds, experts of $expert bytes" | tee "$out/$kind.txt"
    ci/simdrives exec "$bin" "$steps" "$rounds" "$expert" "$mnt" nocheck "$layers" 2>&1 | tee -a "$out/$kind.txt"
    # The ceiling: fio's best on a file of the model's size, same drive.
    size=$((layers * 16 * 3 * expert))
    best=0
    for bs in 1M 4M; do
        for qd in 16 64; do
            for async in 0 1; do
                r=$(ci/simdrives exec fio --name=c --filename="$mnt/fio.dat" --size="$size" --rw=read --bs=$bs \
                    --iodepth=$qd --ioengine=io_uring --direct=1 --fixedbufs=1 --force_async=$async \
                    --registerfiles=1 --output-format=json | python3 -c 'import json,sys; print(json.load(sys.stdin)["jobs"][0]["read"]["bw_bytes"])')
                echo "fio bs=$bs qd=$qd force_async=$async: $((r / 1000000)) MB/s" >>"$out/$kind.txt"
                [ "$r" -gt "$best" ] && best=$r
            done
        done
    done
    echo "fio best: $((best / 1000000)) MB/s" | tee -a "$out/$kind.txt"
    rm -f "$mnt/fio.dat"
done

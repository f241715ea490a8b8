#!/usr/bin/env bash
# The decode loop into caller memory (examples/caller_decode.rs), interleaved
# arms (crate arena, page-aligned caller buffer + placement, lent Vec +
# placement, fixed page-aligned addresses through staging), on each kind of
# simulated drive: memloop (fast, asynchronous completion, as NVMe DMA),
# zram (fast, inline completion) and a loop drive capped at 400 MB/s.
# Usage (root, from the repository root):
#   docs/benchmarks/2026-12-01-caller-memory/run.sh [STEPS] [ROUNDS] [EXPERT_BYTES]
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=docs/benchmarks/2026-12-01-caller-memory
steps=${1:-40}
rounds=${2:-7}
expert=${3:-1048576}
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
        mnt=$(ci/simdrives up 1 --kind loop --mbps 400 --size 2)
    else
        mnt=$(ci/simdrives up 1 --kind "$kind" --size 2)
    fi
    echo "== $kind ($mnt): $steps steps x $rounds rounds, experts of $expert bytes" | tee "$out/$kind.txt"
    ci/simdrives exec "$bin" "$steps" "$rounds" "$expert" "$mnt" 2>&1 | tee -a "$out/$kind.txt"
done

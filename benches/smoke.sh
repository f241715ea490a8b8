#!/usr/bin/env bash
# Every benchmark once, at a small size: that each still runs after a
# change to what they share (benches/machine.sh, benches/benchlib.py,
# benches/clock.h). The figures mean nothing at these sizes; a bench that
# fails is named, with its log. Root (simulated drives, drop_caches).
#
#   benches/smoke.sh [OUT_DIR]        (default /tmp/ws-bench-smoke)
#   ONLY="peers vllm"                 just those (the names below)
#
# Each bench's record goes to OUT_DIR/NAME, its output to OUT_DIR/NAME.log;
# OUT_DIR/summary.txt has one line per bench: ok or FAILED, and seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=${1:-/tmp/ws-bench-smoke}
[ "$(id -u)" = 0 ] || { echo "smoke.sh: SKIP: needs root (simulated drives, drop_caches)"; exit 0; }
mkdir -p "$out"
: > "$out/summary.txt"
cargo build --quiet --release -p weightstream-cli
ws=$root/target/release/weightstream
failed=0

# name, then the command (env assignments and the script): each at about
# the smallest size its model writer takes (`weightstream gen` needs one
# expert of each layer: 8 layers of 19 MiB projections are 456 MiB), one
# round, few arms.
run() {
    local name=$1 t0=$SECONDS rc=0
    shift
    if [ -n "${ONLY:-}" ] && ! grep -qw -- "$name" <<<"$ONLY"; then
        return 0
    fi
    echo "== $name: $*"
    env "$@" > "$out/$name.log" 2>&1 || rc=$?
    if [ "$rc" = 0 ]; then
        printf '%-14s ok      %4ds\n' "$name" $((SECONDS - t0)) | tee -a "$out/summary.txt"
    else
        printf '%-14s FAILED  %4ds  (rc %s; %s)\n' "$name" $((SECONDS - t0)) "$rc" "$out/$name.log" | tee -a "$out/summary.txt"
        tail -5 "$out/$name.log" | sed 's/^/    /'
        failed=$((failed + 1))
    fi
}

run scaling SIZE=0.2e9 RUNS=1 benches/scaling.sh "$out/scaling"
run contention KIND=memloop ROUNDS=1 benches/contention/run.sh
run true-ceiling KINDS="zram1 memloop" RUNS=1 benches/true-ceiling.sh "$out/true-ceiling"
run grown-chunks KINDS=memloop REPS=1 RUNS=1 benches/grown-chunks.sh "$out/grown-chunks.json"
run load KINDS=zram RUNS=1 SIZE=480MiB benches/load.sh "$out/load"
run multidrive CAP_MBPS=400 MODEL_SIZE=240MiB RUNS=1 benches/multidrive.sh "$out/multidrive"
run placement CAP_MBPS=400 MODEL_SIZE=100MiB RUNS=1 benches/placement.sh "$out/placement"
run mirrors CAP_MBPS=400 MODEL_SIZE=240MiB RUNS=1 STEPS=mirror benches/mirrors.sh "$out/mirrors"
run before-after CAP_MBPS=400 RUNS=1 CONC=8 benches/before-after.sh "$ws" "$ws" "$out/before-after"
run capi-decode KINDS=memloop ROUNDS=1 STEPS=2 THREAD_ROUNDS=1 SIZE=480MiB benches/capi-decode.sh "$out/capi-decode"
run expert-cache ROUNDS=1 LAYERS=4 EXPERTS=8 TOPK=2 TOKENS=4 TOKENS_CAPPED=2 benches/expert-cache.sh "$out/expert-cache"
run drives-load LAYOUTS="split:zram:2" ROUNDS=1 SIZE=0.2e9 benches/drives-load.sh "$out/drives-load"
run peers KINDS=memloop ROUNDS=1 SIZE=0.2e9 ARMS="weightstream fresh-read safetensors" benches/peers.sh "$out/peers"
run distributed ROUNDS=1 SIZE=0.1e9 WORLDS="1 2" ARMS="ws-dist ws-each" benches/distributed.sh "$out/distributed"
run load_into KINDS=memloop ROUNDS=1 SIZE=0.2e9 ARMS="load-into ws-load" \
    benches/load_into/bench.sh "$out/load_into"
run vllm KINDS=memloop ROUNDS=1 SIZE=0.2e9 ARMS="vllm-auto vllm-weightstream ws-load" TP_KINDS=" " benches/vllm/bench.sh "$out/vllm"
run moe-decode KINDS=memloop FRACTIONS=0.25 BATCHES=1 ROUNDS=1 TOKENS=4 ARMS="ws-noprefetch mmap" \
    benches/moe-decode/bench.sh "$out/moe-decode"

echo "smoke.sh: $(grep -c ' ok ' "$out/summary.txt") ok, $failed failed ($out/summary.txt)"
[ "$failed" = 0 ]

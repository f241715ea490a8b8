#!/usr/bin/env bash
# vLLM's weight loading through each load format, on a fast simulated
# drive, cold cache, interleaved, median of ROUNDS: what `--load-format
# weightstream` buys a vLLM user, and what the plugin costs over
# weightstream.load alone.
#
#   benches/vllm/bench.sh [OUT_DIR]     (root: simdrives, drop_caches)
#
# Per drive kind (KINDS, default "memloop zram"; "disk" is the machine's
# own root filesystem, DISK_DIR, where drop_caches cannot reach a cache
# under a VM):
#   1. one drive of the kind (simdrives up 1 --kind KIND --size 4) and the
#      reference model written onto it: benches/peers/write_model.py (a
#      Llama-shaped BF16 checkpoint of SIZE bytes, default 1.91e9, 5
#      shards and the index) and a config.json for it (arm.py
#      write-config), then sync
#   2. one discarded warm-up (weightstream.load: the first touch of memory
#      this VM gave back to its host costs several times a later one)
#   3. the load ceiling for the record: weightstream load-ceiling --json
#      (fio's best read of the files over its sweep, the fault-in of fresh
#      memory), as KIND-ceiling.json
#   4. ROUNDS rounds (default 5); in each, every arm (ARMS) in a fresh
#      process of its own after a cold cache (sync; drop_caches), the order
#      rotating by one each round:
#        vllm-auto             LLM(MODEL, load_format="auto") (safetensors)
#        vllm-weightstream     LLM(MODEL, load_format="weightstream"): the plan
#        vllm-weightstream-nocache the plan traced at every load ({"plan_cache":
#                              false}); vllm-weightstream finds it in the plan
#                              cache from its second run on (WEIGHTSTREAM_PLAN_CACHE,
#                              a folder of this run's own, emptied first)
#        vllm-weightstream-noplan  the same with {"plan": false}: the tensors
#                              handed to the model's load_weights
#        vllm-runai_streamer   LLM(MODEL, load_format="runai_streamer")
#        vllm-fastsafetensors  LLM(MODEL, load_format="fastsafetensors")
#        ws-load               weightstream.load(MODEL) alone
#      (benches/vllm/arm.py: vLLM's engine and worker in the arm's own
#      process; the time is the loader's load_weights, the CPU the
#      process's over it, the peak RSS the process's; the vLLM arms' first
#      4 greedy tokens must agree). An arm that fails is recorded
#      (OUT/failures.txt, its JSON and stderr kept) and dropped from the
#      later rounds: fastsafetensors' vLLM iterator targets a CUDA device.
#   5. (kinds in TP_KINDS, default memloop; TP_ROUNDS rounds, default 3)
#      two tensor-parallel workers, spawned as vLLM does by default
#      (TP_ARMS): tp2-auto, tp2-runai_streamer, tp2-weightstream (the plan:
#      each rank reads its slices, and with the others the tensors it cannot
#      read its part of alone), tp2-weightstream-noplan (each rank
#      reads every tensor); the load is the slowest
#      worker's logged time, and weightstream's workers log the bytes each
#      read from storage. Process CPU and RSS are not comparable there (the
#      workers are other processes).
# Then benches/vllm/table.py OUT: OUT/table.md, OUT/summary.json.
#
# Environment: KINDS, ROUNDS, SIZE, ARMS, TP_KINDS, TP_ROUNDS, TP_ARMS,
# DISK_DIR, OUT_DIR as the first argument (default
# docs/benchmarks/DATE-vllm), WS_VLLM_VENV (made by benches/vllm/venv.sh
# when missing), ARM_TIMEOUT (seconds per arm, default 900), KEEP_PAGE_REPORTING=1.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
# shellcheck source=benches/machine.sh
. benches/machine.sh   # $simdrives, cold, machine_*, write_meta
kinds=${KINDS:-memloop zram}
rounds=${ROUNDS:-5}
size=${SIZE:-1.91e9}
arm_timeout=${ARM_TIMEOUT:-900}
out=${1:-docs/benchmarks/$(date +%F)-vllm}
read -r -a arms <<< "${ARMS:-vllm-auto vllm-weightstream vllm-weightstream-nocache vllm-weightstream-noplan vllm-runai_streamer vllm-fastsafetensors ws-load}"
read -r -a tp_arms <<< "${TP_ARMS:-tp2-auto tp2-weightstream tp2-weightstream-noplan tp2-runai_streamer}"
tp_kinds=${TP_KINDS:-memloop}

if [ "$(id -u)" != 0 ]; then echo "vllm bench: SKIP: needs root (simdrives, drop_caches)"; exit 0; fi
cargo build --release --quiet -p weightstream-cli
ws=$root/target/release/weightstream
py=$(benches/vllm/venv.sh)
# This tree's module, release build, in the venv.
CARGO_TARGET_DIR=$root/target "$py" -m pip install --quiet --force-reinstall --no-deps ./python
mkdir -p "$out"
out=$(cd "$out" && pwd)
export SIMDRIVES_BASE=/tmp/ws-vllm-bench SIMDRIVES_CGROUP=ws-vllm-bench
export WEIGHTSTREAM_PLAN_CACHE=/tmp/ws-vllm-bench-plans
rm -rf "$WEIGHTSTREAM_PLAN_CACHE"

machine_save
drives_down() {
    [ -f "$SIMDRIVES_BASE/drives" ] && "$simdrives" down >/dev/null 2>&1
    return 0
}
cleanup() {
    drives_down
    machine_restore
}
trap cleanup EXIT
cleanup
machine_quiet

write_meta "$out/meta.json" python="$py" kinds@="$kinds" rounds:="$rounds" size:="$size" arms@="${arms[*]}"

declare -A dead=()
run_arm() { # kind arm round
    local kind=$1 arm=$2 r=$3 base=$out/$1-$2-$3 rc=0 cmd
    case $arm in
        ws-load) cmd=("$py" benches/vllm/arm.py ws-load "$dir") ;;
        vllm-*) cmd=("$py" benches/vllm/arm.py vllm "${arm#vllm-}" "$dir") ;;
        tp2-*) cmd=("$py" benches/vllm/arm.py vllm-tp2 "${arm#tp2-}" "$dir") ;;
    esac
    cold
    timeout "$arm_timeout" "${cmd[@]}" > "$base.json" 2> "$base.err" || rc=$?
    if [ "$rc" != 0 ]; then
        mv "$base.json" "$base.failed.json" 2>/dev/null || true
        echo "$kind $arm $r rc=$rc ${cmd[*]}" >> "$out/failures.txt"
        echo "  round $r $arm FAILED (rc $rc): $(python3 -c 'import json,sys; print(json.load(open(sys.argv[1])).get("error", "")[:200])' "$base.failed.json" 2>/dev/null)"
        dead[$arm]=1
        return 0
    fi
    rm -f "$base.err"
    python3 -c '
import json, sys
v = json.load(open(sys.argv[1]))
print("  round %s %-24s %6.3f GB/s  %6.3f s  CPU %.3f s/GB  peak RSS %.2f GB%s"
      % (sys.argv[2], v["arm"], v["gbps"], v["load_seconds"], v["cpu_seconds_per_gb"], v["peak_rss_bytes"] / 1e9,
         "  tokens %s" % v["tokens"] if "tokens" in v else ""))' "$base.json" "$r"
}

for kind in $kinds; do
    if [ "$kind" = disk ]; then
        # The machine's own disk (its root filesystem): no simulated drive.
        dir=${DISK_DIR:-/var/tmp/ws-vllm-bench-disk}/model
        rm -rf "$dir"
        mkdir -p "$dir"
    else
        mapfile -t mnts < <("$simdrives" up 1 --kind "$kind" --size 4)
        dir=${mnts[0]}/model
    fi
    "$py" benches/peers/write_model.py "$dir" --bytes "$size" >/dev/null
    "$py" benches/vllm/arm.py write-config "$dir" >/dev/null
    sync
    echo "== $kind: $(du -sh "$dir" | cut -f1) in $dir"
    cold
    "$py" benches/vllm/arm.py ws-load "$dir" >/dev/null 2>&1 || true
    cold
    if "$ws" load-ceiling "$dir" --json > "$out/$kind-ceiling.json" 2> "$out/$kind-ceiling.err"; then
        rm -f "$out/$kind-ceiling.err"
        python3 -c 'import json,sys; v=json.load(open(sys.argv[1])); print("  load ceiling %.3f GB/s (fio %.3f, fault %.3f)" % (v["gbps"], v["fio"]["gbps"], v["fault"]["gbps"]))' "$out/$kind-ceiling.json"
    fi
    dead=()
    for r in $(seq 1 "$rounds"); do
        k=$(( (r - 1) % ${#arms[@]} ))
        for arm in "${arms[@]:k}" "${arms[@]:0:k}"; do
            [ -z "${dead[$arm]:-}" ] || continue
            run_arm "$kind" "$arm" "$r"
        done
    done
    if [[ " $tp_kinds " == *" $kind "* ]]; then
        for r in $(seq 1 "${TP_ROUNDS:-3}"); do
            k=$(( (r - 1) % ${#tp_arms[@]} ))
            for arm in "${tp_arms[@]:k}" "${tp_arms[@]:0:k}"; do
                [ -z "${dead[$arm]:-}" ] || continue
                run_arm "$kind" "$arm" "$r"
            done
        done
    fi
    if [ "$kind" = disk ]; then rm -rf "$dir"; else drives_down; fi
done
python3 benches/vllm/table.py "$out"

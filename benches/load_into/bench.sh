#!/usr/bin/env bash
# weightstream.torch.load_into against the ways a user fills a model today,
# on a fast simulated drive, cold cache, interleaved, median of ROUNDS:
# what memory the load adds on top of the allocated model, how fast, how
# much CPU.
#
#   benches/load_into/bench.sh [OUT_DIR]     (root: simdrives, drop_caches)
#
# 1. a Llama-shaped bf16 checkpoint of about SIZE bytes (default 1.91e9)
#    written by transformers (save_pretrained, 500 MB shards), once, on the
#    virtio disk (arm.py write), then copied onto each drive
# Per drive kind (KINDS, default "memloop zram"), one drive of 4 GB:
# 2. one discarded warm-up (weightstream.load)
# 3. the load ceiling for the record (weightstream load-ceiling --json:
#    fio's best over its sweep, and the fault-in of fresh memory)
# 4. ROUNDS rounds (default 5); in each, every arm in a fresh process after
#    a cold cache (sync; drop_caches), the order rotating by one each round:
#      load-into     weightstream.torch.load_into(model, dir)
#      ws-load-lsd   weightstream.load(dir) + model.load_state_dict(sd)
#      st-load-lsd   safetensors.torch.load_file(shard) for each + load_state_dict
#      ws-load       weightstream.load(dir) alone: fresh memory, no model
#      cli-load      `weightstream load dir --json` (Engine::load_all)
#    (arm.py: the model built from the checkpoint's config, its parameters
#    allocated and touched, before the timed load; the arms that fill the
#    model must leave the same digest of its bytes)
# Then benches/load_into/table.py OUT: OUT/table.md, OUT/summary.json.
#
# Environment: KINDS, ROUNDS, SIZE, WS_VLLM_VENV (the venv with torch,
# transformers and safetensors: benches/vllm/venv.sh), KEEP_PAGE_REPORTING=1.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
# shellcheck source=benches/machine.sh
. benches/machine.sh   # $simdrives, cold, machine_*, write_meta
kinds=${KINDS:-memloop zram}
rounds=${ROUNDS:-5}
size=${SIZE:-1.91e9}
out=${1:-docs/benchmarks/$(date +%F)-load-into}
read -r -a arms <<< "${ARMS:-load-into ws-load-lsd st-load-lsd ws-load cli-load}"

if [ "$(id -u)" != 0 ]; then echo "load_into bench: SKIP: needs root (simdrives, drop_caches)"; exit 0; fi
cargo build --release --quiet -p weightstream-cli
ws=$root/target/release/weightstream
py=$(benches/vllm/venv.sh)
CARGO_TARGET_DIR=$root/target "$py" -m pip install --quiet --force-reinstall --no-deps ./python
mkdir -p "$out"
out=$(cd "$out" && pwd)
export SIMDRIVES_BASE=/tmp/ws-load-into-bench SIMDRIVES_CGROUP=ws-load-into-bench

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

src=${SRC_MODEL:-/var/tmp/ws-load-into-model-$size}
if [ ! -f "$src/model.safetensors.index.json" ]; then
    rm -rf "$src"
    "$py" benches/load_into/arm.py write "$src" "$size"
fi
write_meta "$out/meta.json" python="$py" kinds@="$kinds" rounds:="$rounds" size:="$size" arms@="${arms[*]}"

run_arm() { # kind arm round
    local kind=$1 arm=$2 r=$3 base=$out/$1-$2-$3 rc=0
    cold
    if [ "$arm" = cli-load ]; then
        "$ws" load "$dir" --json > "$base.json" 2> "$base.err" || rc=$?
    else
        "$py" benches/load_into/arm.py "$arm" "$dir" > "$base.json" 2> "$base.err" || rc=$?
    fi
    if [ "$rc" != 0 ]; then
        echo "$kind $arm $r rc=$rc" >> "$out/failures.txt"
        echo "  round $r $arm FAILED (rc $rc): $(tail -3 "$base.err")"
        return 0
    fi
    rm -f "$base.err"
    python3 benches/load_into/table.py --line "$base.json" "$arm" "$r"
}

for kind in $kinds; do
    mapfile -t mnts < <("$simdrives" up 1 --kind "$kind" --size 4)
    dir=${mnts[0]}/model
    mkdir -p "$dir"
    cp "$src"/*.safetensors "$src"/*.json "$dir"/
    sync
    echo "== $kind: $(du -sh "$dir" | cut -f1) in $dir"
    cold
    "$py" benches/load_into/arm.py ws-load "$dir" >/dev/null 2>&1 || true
    cold
    if "$ws" load-ceiling "$dir" --json > "$out/$kind-ceiling.json" 2> "$out/$kind-ceiling.err"; then
        rm -f "$out/$kind-ceiling.err"
        python3 -c 'import json,sys; v=json.load(open(sys.argv[1])); print("  load ceiling %.3f GB/s (fio %.3f, fault %.3f)" % (v["gbps"], v["fio"]["gbps"], v["fault"]["gbps"]))' "$out/$kind-ceiling.json"
    fi
    for r in $(seq 1 "$rounds"); do
        k=$(( (r - 1) % ${#arms[@]} ))
        for arm in "${arms[@]:k}" "${arms[@]:0:k}"; do
            run_arm "$kind" "$arm" "$r"
        done
    done
    drives_down
done
python3 benches/load_into/table.py "$out"

#!/usr/bin/env bash
# Mixture-of-experts decode with the routed experts larger than memory:
# tokens/s of each way a transformers user could run it, every arm but
# the bound in a memory cgroup of the same size, cold cache, interleaved.
#
#   benches/moe-decode/bench.sh [OUT_DIR]     (root: simdrives, cgroups, drop_caches)
#
# 1. the model, once (arm.py write, on the virtio disk: SRC_MODEL): a
#    Qwen3-MoE of transformers 5 (hidden 1024, 16 layers, 64 experts of
#    which 4 per token, synthetic weights), experts fused as transformers
#    holds them, 3.2 GB of routed experts, bf16
# Per drive kind (KINDS, default "memloop"; "disk" is the root filesystem):
# 2. one drive of 8 GB with the model copied on (and transformers' offload
#    folder, which its disk offload writes at every load)
# 3. per FRACTIONS (default "0.25 0.5") and BATCHES (default "1 4"),
#    ROUNDS rounds (default 3); in each, every arm (ARMS) in a fresh
#    process after a cold cache, the order rotating each round:
#      ws-prefetch, ws-noprefetch   weightstream.transformers.from_pretrained with
#                                   an expert budget of FRACTION of the experts
#      tf-offload                   transformers' disk offload (device_map="auto",
#                                   max_memory the same budget, offload_folder)
#      mmap                         parameters mmapped from the shards (llama.cpp's way)
#    each in a memory cgroup of: the non-expert weights + FRACTION of the
#    experts + BASELINE (default 1.5 GB: torch's and transformers' own memory,
#    the activations, the KV cache and the staging; the same for every arm)
#      full                         everything in memory, no limit (the bound;
#                                   once per batch size)
#    TOKENS new tokens (default 64) per prompt, greedy; every arm's tokens
#    must agree.
# Then benches/moe-decode/table.py OUT: OUT/table.md, OUT/summary.json.
#
# Environment: KINDS, FRACTIONS, BATCHES, ROUNDS, TOKENS, ARMS, BASELINE,
# SRC_MODEL, WS_VLLM_VENV (benches/vllm/venv.sh), KEEP_PAGE_REPORTING=1.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
# shellcheck source=benches/machine.sh
. benches/machine.sh   # $simdrives, cold, machine_*, write_meta
kinds=${KINDS:-memloop}
fractions=${FRACTIONS:-0.25 0.5}
batches=${BATCHES:-1 4}
rounds=${ROUNDS:-3}
tokens=${TOKENS:-64}
baseline=${BASELINE:-1.5e9}
out=${1:-docs/benchmarks/$(date +%F)-moe-decode}
read -r -a arms <<< "${ARMS:-ws-prefetch ws-noprefetch tf-offload mmap}"

if [ "$(id -u)" != 0 ]; then echo "moe-decode bench: SKIP: needs root (simdrives, cgroups, drop_caches)"; exit 0; fi
py=$(benches/vllm/venv.sh)
"$py" -c 'import accelerate' 2>/dev/null || "$py" -m pip install --quiet --disable-pip-version-check --no-deps "accelerate==1.16.0"
CARGO_TARGET_DIR=$root/target "$py" -m pip install --quiet --force-reinstall --no-deps ./python
mkdir -p "$out"
out=$(cd "$out" && pwd)
export SIMDRIVES_BASE=/tmp/ws-moe-bench SIMDRIVES_CGROUP=ws-moe-bench
cg=/sys/fs/cgroup/memory/ws-moe-decode

machine_save
drives_down() {
    [ -f "$SIMDRIVES_BASE/drives" ] && "$simdrives" down >/dev/null 2>&1
    return 0
}
cleanup() {
    drives_down
    [ -d "$cg" ] && rmdir "$cg" 2>/dev/null
    machine_restore
}
trap cleanup EXIT
cleanup
machine_quiet

src=${SRC_MODEL:-/var/tmp/ws-moe-decode-model}
if [ ! -f "$src/model.safetensors.index.json" ]; then
    rm -rf "$src"
    "$py" benches/moe-decode/arm.py write "$src"
fi
read -r expert_bytes other_bytes < <("$py" -c '
import json, sys
sys.path.insert(0, "benches/moe-decode")
import arm
s = arm.sizes(sys.argv[1])
print(s["expert_bytes"], s["other_bytes"])' "$src")
write_meta "$out/meta.json" kinds@="$kinds" fractions:="[${fractions// /,}]" batches:="[${batches// /,}]" \
    rounds:="$rounds" tokens:="$tokens" baseline:="$baseline" arms@="${arms[*]}" expert_bytes:="$expert_bytes" \
    other_bytes:="$other_bytes"

mkdir -p "$cg"
run_arm() { # kind arm fraction batch round
    local kind=$1 arm=$2 f=$3 b=$4 r=$5 base=$out/$1-$2-f$3-b$4-$5 rc=0 limit
    cold
    rm -rf "$off"
    if [ "$arm" = full ]; then
        limit=-1
    else
        limit=$(python3 -c "print(int($other_bytes + $f * $expert_bytes + $baseline))")
    fi
    echo "$limit" > "$cg/memory.limit_in_bytes"
    echo 0 > "$cg/memory.max_usage_in_bytes" 2>/dev/null || true
    sh -c 'echo $$ > "$1/cgroup.procs"; shift; exec "$@"' _ "$cg" \
        "$py" benches/moe-decode/arm.py "$arm" "$dir" "$f" "$b" "$tokens" "$off" > "$base.json" 2> "$base.err" || rc=$?
    local used; used=$(cat "$cg/memory.max_usage_in_bytes")
    if [ "$rc" != 0 ]; then
        mv "$base.json" "$base.failed.json" 2>/dev/null || true
        echo "$kind $arm f$f b$b $r rc=$rc (cgroup limit $limit, max usage $used)" >> "$out/failures.txt"
        echo "  round $r $arm f$f b$b FAILED (rc $rc, limit $limit, max usage $used): $(tail -2 "$base.err" | cut -c1-200)"
        return 0
    fi
    rm -f "$base.err"
    python3 - "$base.json" "$limit" "$used" "$r" <<'PYEOF'
import json, sys
p, limit, used, r = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
v = json.load(open(p))
v["cgroup_limit_bytes"], v["cgroup_max_usage_bytes"] = limit, used
json.dump(v, open(p, "w"))
pt = v.get("per_token")
extra = "" if not pt else "  per step: %.1f misses, %.1f prefetch used, %.4f s waited, %.1f MB read" % (
    pt["misses"], pt["prefetch_used"], pt["wait_seconds"], pt["bytes_read"] / 1e6)
print("  round %s %-14s f%.2f b%d %7.3f tok/s  load %.1f s  peak RSS %.2f GB  cgroup max %.2f GB%s" % (
    r, v["arm"], v["fraction"], v["batch"], v["tokens_per_second"], v["load_seconds"], v["peak_rss_bytes"] / 1e9, used / 1e9, extra))
PYEOF
}

for kind in $kinds; do
    if [ "$kind" = disk ]; then
        root_dir=${DISK_DIR:-/var/tmp/ws-moe-bench-disk}
        rm -rf "$root_dir"
        mkdir -p "$root_dir"
    else
        mapfile -t mnts < <("$simdrives" up 1 --kind "$kind" --size 8)
        root_dir=${mnts[0]}
    fi
    dir=$root_dir/model
    off=$root_dir/offload
    mkdir -p "$dir"
    cp "$src"/*.safetensors "$src"/*.json "$dir"/
    sync
    echo "== $kind: $(du -sh "$dir" | cut -f1) in $dir"
    for b in $batches; do
        run_arm "$kind" full 1 "$b" 1
        for f in $fractions; do
            for r in $(seq 1 "$rounds"); do
                k=$(( (r - 1) % ${#arms[@]} ))
                for arm in "${arms[@]:k}" "${arms[@]:0:k}"; do
                    run_arm "$kind" "$arm" "$f" "$b" "$r"
                done
            done
        done
    done
    if [ "$kind" = disk ]; then rm -rf "$root_dir"; else drives_down; fi
done
python3 benches/moe-decode/table.py "$out"

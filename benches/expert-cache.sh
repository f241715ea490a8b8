#!/usr/bin/env bash
# The expert cache against its alternatives on a MoE decode trace (issue 39):
# each arm of examples/expert_cache_bench.rs in a process of its own, cold,
# interleaved over ROUNDS rounds, on one fast drive (memloop: completes
# asynchronously, as NVMe does) and on two capped drives (the model split
# over them, and mirrored on both). Root only.
#
# Usage: benches/expert-cache.sh [OUT_DIR]
#   ROUNDS        interleaved rounds                  default 3
#   LAYERS EXPERTS EXPERT_BYTES TOPK                  default 16 64 1MiB 8
#   BUDGET        experts the cache holds             default LAYERS*EXPERTS/4
#   TOKENS        tokens on the fast drive            default 48
#   TOKENS_CAPPED tokens on the capped drives         default 16
#   CAP_MBPS      each capped drive's cap (MB/s)      default 600
#   COMPUTE_US    fake compute per layer (us)         default 2000
#   ACCURACY      the prefetch predictor's accuracy   default 0.8
# Writes OUT_DIR/<layout>-<arm>-<round>.json (<layout>-missrate-<round>.json: the
# cache arm with no compute, for the misses' rate), meta.json and table.md
# (benches/expert-cache-table.py); default docs/benchmarks/DATE-expert-cache.
#
# The page-cache arm runs in a memory cgroup (v1 memory or v2) limited to
# the cache arms' slot budget plus 32 MiB for the process itself, so the
# page cache holds about as many experts as the cache does.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
# shellcheck source=benches/machine.sh
. benches/machine.sh   # $simdrives, cold, machine_*, write_meta
rounds=${ROUNDS:-3}
layers=${LAYERS:-16} experts=${EXPERTS:-64} expert_bytes=${EXPERT_BYTES:-1MiB} topk=${TOPK:-8}
budget=${BUDGET:-$((layers * experts / 4))}
tokens=${TOKENS:-48} tokens_capped=${TOKENS_CAPPED:-16}
cap=${CAP_MBPS:-600} compute=${COMPUTE_US:-2000} accuracy=${ACCURACY:-0.8}
out=${1:-docs/benchmarks/$(date +%F)-expert-cache}

if [ "$(id -u)" != 0 ]; then echo "expert-cache: SKIP: needs root (simdrives, drop_caches, memory cgroup)"; exit 0; fi
cargo build --release --quiet --example expert_cache_bench
cargo build --release --quiet
bench=$root/target/release/examples/expert_cache_bench
ws=$root/target/release/weightstream
mkdir -p "$out"
out=$(cd "$out" && pwd)
machine_take ws-expert-cache-bench

# The memory cgroup of the page-cache arm.
if [ -d /sys/fs/cgroup/memory ]; then
    memcg=/sys/fs/cgroup/memory/ws-expert-cache
    mkdir -p "$memcg"
    set_limit() { echo "$1" > "$memcg/memory.limit_in_bytes"; echo 0 > "$memcg/memory.max_usage_in_bytes" 2>/dev/null || true; }
    peak_of() { cat "$memcg/memory.max_usage_in_bytes"; }
else
    memcg=/sys/fs/cgroup/ws-expert-cache
    mkdir -p "$memcg"
    set_limit() { echo "$1" > "$memcg/memory.max"; }
    peak_of() { cat "$memcg/memory.peak" 2>/dev/null || echo 0; }
fi
trap 'machine_give_back; rmdir "$memcg" 2>/dev/null || true' EXIT

write_meta "$out/meta.json" rounds:="$rounds" layers:="$layers" experts:="$experts" expert_bytes="$expert_bytes" \
    top_k:="$topk" budget_experts:="$budget" tokens:="$tokens" tokens_capped:="$tokens_capped" cap_mbps:="$cap" \
    compute_us:="$compute" accuracy:="$accuracy"

# One arm: LAYOUT ARM ROUND TOKENS MODEL [bench args...]
arm() {
    local layout=$1 a=$2 r=$3 n=$4 model=$5 limit f
    shift 5
    f=$out/$layout-$a-$r.json
    cold
    local cmd=("$bench" "$model" "$a" --budget-experts "$budget" --tokens "$n" --top-k "$topk"
        --compute-us "$compute" --accuracy "$accuracy" "$@")
    if [ "$a" = pagecache ]; then
        limit=$(( $(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["budget_bytes"])' "$out/$layout-cache-$r.json") + (32 << 20) ))
        set_limit "$limit"
        "$simdrives" exec bash -c 'echo $$ > "$0/cgroup.procs" 2>/dev/null || echo $$ > "$0/tasks"; exec "$@"' "$memcg" "${cmd[@]}" > "$f"
        python3 - "$f" "$limit" "$(peak_of)" <<'EOF'
import json, sys
v = json.load(open(sys.argv[1]))
v["memcg_limit_bytes"] = int(sys.argv[2])
v["memcg_peak_bytes"] = int(sys.argv[3])
json.dump(v, open(sys.argv[1], "w"))
EOF
    else
        "$simdrives" exec "${cmd[@]}" > "$f"
    fi
    python3 -c 'import json,sys; v=json.load(open(sys.argv[1])); print("  %-8s %-9s round %s: wait/token median %.1f ms p99 %.1f ms, %.1f MB read/token, hit rate %s" % (sys.argv[2], v["arm"], sys.argv[3], v["wait_per_token_median_s"]*1e3, v["wait_per_token_p99_s"]*1e3, v["bytes_read_per_token"]/1e6, v.get("hit_rate", "-")))' "$f" "$layout" "$r"
}

gen_model() { # DIR
    [ -f "$1/model.safetensors.index.json" ] || "$ws" gen "$1" --layers "$layers" --experts "$experts" \
        --expert-bytes "$expert_bytes" --shards 4 >/dev/null
}

echo "== one fast drive (memloop)"
mapfile -t mnt < <("$simdrives" up 1 --kind memloop --size 8)
gen_model "${mnt[0]}/model"
for r in $(seq "$rounds"); do
    for a in cache prefetch direct pagecache; do
        arm fast "$a" "$r" "$tokens" "${mnt[0]}/model"
    done
done
"$simdrives" down >/dev/null

echo "== two capped drives ($cap MB/s each): split, mirror"
mapfile -t mnt < <("$simdrives" up 2 --kind memloop --size 8 --mbps "$cap,$cap")
src=${mnt[0]}/src
gen_model "$src"
mkdir -p "${mnt[0]}/split" "${mnt[1]}/split" "${mnt[0]}/mirror" "${mnt[1]}/mirror"
split=$("$ws" place "$src" --to "${mnt[0]}/split;${mnt[1]}/split" --layout split --allow-source-volume | sed -n 's/^open the placed model at: //p')
mirror=$("$ws" place "$src" --to "${mnt[0]}/mirror;${mnt[1]}/mirror" --layout mirror --allow-source-volume | sed -n 's/^open the placed model at: //p')
rm -rf "$src"
for r in $(seq "$rounds"); do
    for a in cache prefetch direct pagecache; do
        arm split "$a" "$r" "$tokens_capped" "$split"
        arm mirror "$a" "$r" "$tokens_capped" "$mirror"
    done
    # The misses' rate with nothing between the reads: the cache arm with
    # no compute, so the drives are never idle (an idle capped drive banks
    # credit: reads after a pause beat its cap, which a rate taken across
    # the compute gaps would claim).
    for l in split mirror; do
        model=$split
        [ "$l" = mirror ] && model=$mirror
        cold
        "$simdrives" exec "$bench" "$model" cache --budget-experts "$budget" --tokens "$tokens_capped" \
            --top-k "$topk" --compute-us 0 > "$out/$l-missrate-$r.json"
    done
done

python3 benches/expert-cache-table.py "$out" > "$out/table.md"
cat "$out/table.md"
benches/pack-raw.sh "$out"

#!/usr/bin/env bash
# Whole-model loads of one model placed over several drives against the
# bare read of the same files reading all the drives at once, cold cache,
# interleaved, median of per-round ratios (issue 38: at least 0.95).
#
#   benches/drives-load.sh [OUT_DIR]      (root: simdrives, drop_caches)
#
# LAYOUTS (default "split:zram:2 mirror:memloop:2"): each LAYOUT:KIND:N is
# N fresh drives of KIND (simdrives up N --kind KIND --size 4) and the
# reference model (benches/peers/write_model.py, SIZE bytes, default 1.91e9,
# written once on the virtio disk) placed on them by `weightstream place
# --layout LAYOUT` (split: each shard on one drive, bytes balanced; mirror:
# a full copy on each drive). Per layout:
#   1. the digest of every tensor through the placed layout, against the
#      reference reader's (benches/peers/arm.py digest-reference);
#   2. the bare read's configuration: fresh_read (benches/peers/fresh_read.c)
#      over every drive's files at once (split: every shard where it lies;
#      mirror: -m N, block i of a file from copy i mod N), threads x block
#      size the best of FRESH_SWEEP (default "2x1M 4x1M 8x1M 2x4M 4x4M
#      8x4M"), each cold;
#   3. ROUNDS rounds (default 5), the order alternating: `weightstream load
#      PRIMARY --json` (the layout index sends it to every drive) and
#      fresh_read with that configuration.
# Then OUT/table.md and OUT/summary.json (benches/drives-table.py).
#
# Environment: LAYOUTS, ROUNDS, SIZE, WS_PEERS_VENV, KEEP_PAGE_REPORTING=1.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
# shellcheck source=benches/machine.sh
. benches/machine.sh   # $simdrives, cold, machine_*, write_meta
layouts=${LAYOUTS:-split:zram:2 mirror:memloop:2}
rounds=${ROUNDS:-5}
size=${SIZE:-1.91e9}
out=${1:-docs/benchmarks/$(date +%F)-drives-load}
if [ "$(id -u)" != 0 ]; then echo "drives-load: SKIP: needs root (simdrives, drop_caches)"; exit 0; fi
cargo build --release --quiet -p weightstream-cli
ws=$root/target/release/weightstream
py=$(benches/peers/venv.sh)
fresh_read=$(mktemp -d)/fresh_read
cc -O2 -pthread -o "$fresh_read" benches/peers/fresh_read.c
mkdir -p "$out"
out=$(cd "$out" && pwd)
machine_take ws-drives-load-bench

src=/var/tmp/ws-drives-load-model-$size
if [ ! -f "$src/model.safetensors.index.json" ]; then
    rm -rf "$src"
    "$py" benches/peers/write_model.py "$src" --bytes "$size"
fi
"$py" benches/peers/arm.py digest-reference "$src" --digest "$out/reference.sha256" > /dev/null

write_meta "$out/meta.json" layouts@="$layouts" rounds:="$rounds" size:="$size"

gbps() { python3 -c 'import json,sys; print("%.3f" % json.load(open(sys.argv[1]))["gbps"])' "$1"; }

for spec in $layouts; do
    IFS=: read -r layout kind n <<< "$spec"
    name=$layout-$kind-$n
    mapfile -t mnts < <("$simdrives" up "$n" --kind "$kind" --size 4)
    to=$(IFS=';'; echo "${mnts[*]}")
    "$ws" place "$src" --to "$to" --layout "$layout" --json > "$out/$name-place.json"
    primary=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["primary"])' "$out/$name-place.json")
    # Every shard file where it lies, per drive (the primary's folder name
    # under each root).
    folder=$(basename "$primary")
    files=()
    if [ "$layout" = mirror ]; then
        for m in "${mnts[@]}"; do
            files+=($(ls "$m/$folder"/*.safetensors | sort))
        done
        fr=(-m "$n")
    else
        for m in "${mnts[@]}"; do
            files+=($(ls "$m/$folder"/*.safetensors 2>/dev/null || true))
        done
        fr=()
    fi
    echo "== $name: $(du -shc "${mnts[@]/%//$folder}" | tail -1 | cut -f1) on ${mnts[*]} (${#files[@]} files)"
    cold
    "$ws" load "$primary" --json --digest > "$out/$name-digest.json"
    python3 -c '
import json, sys
v = json.load(open(sys.argv[1]))
with open(sys.argv[2], "w") as f:
    f.writelines(f"{h}  {n}\n" for n, h in sorted(v["tensors_sha256"].items()))' "$out/$name-digest.json" "$out/$name.sha256"
    cmp -s "$out/$name.sha256" "$out/reference.sha256" || { echo "drives-load: $name: the tensors differ from the reference" >&2; exit 1; }
    echo "  every tensor's sha256 equals the reference's"
    bare_read_sweep "$out/$name-freshsweep.json" "$fresh_read" "${fr[@]}" -- "${files[@]}"
    for r in $(seq 1 "$rounds"); do
        order=(weightstream fresh-read)
        [ $((r % 2)) = 0 ] && order=(fresh-read weightstream)
        for arm in "${order[@]}"; do
            cold
            if [ "$arm" = weightstream ]; then
                "$ws" load "$primary" --json > "$out/$name-$arm-$r.json"
            else
                "$fresh_read" "${fr[@]}" -b "$fresh_block" "$fresh_threads" 1 "${files[@]}" > "$out/$name-$arm-$r.json"
            fi
            echo "  round $r $arm $(gbps "$out/$name-$arm-$r.json") GB/s"
        done
    done
    "$simdrives" down >/dev/null 2>&1 || true
done
python3 benches/drives-table.py "$out"

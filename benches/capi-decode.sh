#!/usr/bin/env bash
# The C ABI's decode loop against the Rust engine's, on fast simulated
# drives, interleaved: crates/capi/examples/decode.c (through
# libweightstream.so) and its twin crates/capi/examples/decode.rs (the Rust
# API) read the same experts in the same order (the same router), cold
# cache, one process per run. Root only.
#
#   benches/capi-decode.sh [OUT_DIR]
#   KINDS (default "memloop zram"), ROUNDS (default 10), STEPS (default 6),
#   K (experts per layer per step, default 4), SIZE (gen --size, default 2GiB),
#   THREAD_ROUNDS (rounds of examples/submit_threads.c at 1, 2, 4, 8 threads, default 3)
# Writes OUT_DIR/KIND.jsonl (one line per run, with "arm") and
# OUT_DIR/table.md (medians, the C/Rust ratio of each round's pair,
# CPU s/GB). Default OUT_DIR: docs/benchmarks/DATE-capi-decode.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
[ "$(id -u)" = 0 ] || { echo "capi-decode: SKIP: needs root (simdrives, drop_caches)"; exit 0; }
# shellcheck source=benches/machine.sh
. benches/machine.sh   # $simdrives, cold, machine_*, write_meta
kinds=${KINDS:-memloop zram}
rounds=${ROUNDS:-10}
steps=${STEPS:-6}
k=${K:-4}
size=${SIZE:-2GiB}
out=${1:-docs/benchmarks/$(date +%F)-capi-decode}
mkdir -p "$out"
cargo build --release --quiet -p weightstream-cli -p weightstream-capi
cargo build --release --quiet -p weightstream-capi --example decode
rel=$root/target/release
tmp=$(mktemp -d)
mkdir -p "$tmp/lib"
ln -s "$rel/libweightstream.so" "$tmp/lib/libweightstream.so"
ln -s "$rel/libweightstream.so" "$tmp/lib/libweightstream.so.1"
cc -std=c11 -O2 -Wall -Wextra -Werror -Icrates/capi/include crates/capi/examples/decode.c \
    -L"$tmp/lib" -lweightstream -Wl,-rpath,"$tmp/lib" -o "$tmp/decode-c"
cc -std=c11 -O2 -Wall -Wextra -Werror -Icrates/capi/include crates/capi/examples/submit_threads.c \
    -L"$tmp/lib" -lweightstream -lpthread -Wl,-rpath,"$tmp/lib" -o "$tmp/submit-threads"
export SIMDRIVES_BASE=/tmp/ws-capi-decode
cleanup() { "$simdrives" down >/dev/null 2>&1 || true; rm -rf "$tmp"; }
trap cleanup EXIT
cold() { sync; echo 3 > /proc/sys/vm/drop_caches; }
for kind in $kinds; do
    "$simdrives" down >/dev/null 2>&1 || true
    mapfile -t mnts < <("$simdrives" up 1 --kind "$kind" --size 4)
    dir=${mnts[0]}/model
    "$rel/weightstream" gen "$dir" --size "$size" >/dev/null
    # Once, checked: every payload equals the file's bytes, no fallback.
    "$tmp/decode-c" "$dir" 1 "$k" 1 > /dev/null
    : > "$out/$kind.jsonl"
    for r in $(seq 1 "$rounds"); do
        # The order alternates, so neither arm always runs first.
        if (( r % 2 )); then order="c rust"; else order="rust c"; fi
        for arm in $order; do
            cold
            if [ "$arm" = c ]; then
                line=$("$tmp/decode-c" "$dir" "$steps" "$k" 0)
            else
                line=$("$rel/examples/decode" "$dir" "$steps" "$k")
            fi
            echo "{\"arm\": \"$arm\", \"round\": $r, ${line#\{}" >> "$out/$kind.jsonl"
        done
    done
    # Submission from 1, 2, 4 and 8 threads into one memory (64 KiB reads,
    # one in flight per thread), THREAD_ROUNDS interleaved rounds of 2 s.
    : > "$out/$kind-threads.jsonl"
    for r in $(seq 1 "${THREAD_ROUNDS:-3}"); do
        for t in 1 2 4 8; do
            cold
            "$tmp/submit-threads" "$dir" "$t" 2 65536 >> "$out/$kind-threads.jsonl"
        done
    done
    "$simdrives" down >/dev/null 2>&1 || true
done
python3 - "$out" $kinds > "$out/table.md" <<'PY'
import json, statistics as st, sys
out, kinds = sys.argv[1], sys.argv[2:]
print("| drive | arm | GB/s median (min-max) | C / Rust, per round (min-max) | CPU s/GB | runs | bytes per run |")
print("|---|---|---|---|---|---|---|")
for kind in kinds:
    rows = [json.loads(l) for l in open(f"{out}/{kind}.jsonl")]
    by = {a: [r for r in rows if r["arm"] == a] for a in ("rust", "c")}
    rust = {r["round"]: r for r in by["rust"]}
    ratio = [r["gbps"] / rust[r["round"]]["gbps"] for r in by["c"] if r["round"] in rust]
    for arm, label in (("rust", "Rust API (examples/decode.rs)"), ("c", "C ABI (examples/decode.c)")):
        g = [r["gbps"] for r in by[arm]]
        cpu = st.median(r["cpu_s_per_gb"] for r in by[arm])
        rr = f"{st.median(ratio):.3f} ({min(ratio):.2f}-{max(ratio):.2f})" if arm == "c" else "1"
        bad = sum(r["fallbacks"] + r["staged"] for r in by[arm])
        print(f"| {kind} | {label} | {st.median(g):.3f} ({min(g):.2f}-{max(g):.2f}) | {rr} | {cpu:.4f} | {len(g)} | {by[arm][0]['bytes']} |" + (f" fallbacks/staged: {bad}" if bad else ""))
print()
print("| drive | threads submitting (64 KiB reads, one in flight each) | reads/s median | x one thread | GB/s |")
print("|---|---|---|---|---|")
for kind in kinds:
    try:
        rows = [json.loads(l) for l in open(f"{out}/{kind}-threads.jsonl")]
    except FileNotFoundError:
        continue
    one = st.median(r["reads_per_s"] for r in rows if r["threads"] == 1)
    for t in sorted({r["threads"] for r in rows}):
        v = [r for r in rows if r["threads"] == t]
        rps = st.median(r["reads_per_s"] for r in v)
        print(f"| {kind} | {t} | {rps:.0f} | {rps / one:.2f} | {st.median(r['gbps'] for r in v):.3f} |")
PY
cat "$out/table.md"

#!/usr/bin/env bash
# weightstream against the peer loaders, whole model into process memory,
# on a fast simulated drive, cold cache, interleaved, median of ROUNDS,
# with the load ceiling measured in the same run.
#
#   benches/peers.sh [OUT_DIR]       (root: simdrives, drop_caches, hugetlb pool)
#
# Per drive kind (KINDS, default "memloop zram"):
#   1. one drive of the kind (simdrives up 1 --kind KIND --size 4) and the
#      reference model written onto it by benches/peers/write_model.py (a
#      Llama-shaped BF16 checkpoint of SIZE bytes, default 1.91e9, 5 shards
#      and model.safetensors.index.json, by safetensors.torch), then sync;
#      the reference digests of its tensors (benches/peers/arm.py
#      digest-reference: each file's header parsed, each tensor's bytes read
#      and hashed, no loader involved)
#   2. one discarded warm-up load (as benches/load.sh: the first touch of
#      memory this VM gave back to its host costs several times a later one)
#   3. the load ceiling: weightstream load-ceiling MODEL_DIR --json (gbps,
#      the ceiling; bound: read, fault or cpu; fio's best read of the files,
#      the fault rate of fresh memory, the CPU), kept as KIND-ceiling-0.json
#   4. ROUNDS rounds (default 5); in each, every arm in its own fresh process
#      after a cold cache (sync; drop_caches), in an order that rotates by
#      one each round:
#        weightstream     weightstream load MODEL_DIR --json
#        weightstream-reused  weightstream load MODEL_DIR --json --memory reused:
#                         Engine::load_all_into memory a first (untimed) load
#                         wrote; judged against fio's best, not the load
#                         ceiling (no fresh memory). Its timed load is the
#                         files' second read in a row, which a memloop
#                         drive serves slower than a first (6 rounds: 11
#                         of 12 second reads slower than the first)
#        weightstream-faulted  weightstream load MODEL_DIR --json --memory
#                         faulted: Engine::load_all_into a registered arena
#                         faulted in by a write to every page, never read
#                         into: the timed load is the files' first read
#                         after the cold step, as each round's fio is;
#                         judged against fio's best
#        fresh-read       benches/peers/fresh_read.c: the shards' bytes read
#                         O_DIRECT with preads into one fresh mapping on
#                         huge pages, no tensors: the least a loader can do,
#                         what this machine gives a read into fresh memory
#                         (fio's buffers are few and reused). Its threads
#                         and block size are the best of a sweep run once
#                         per kind before the rounds (FRESH_SWEEP, default
#                         2, 4 and 8 threads x 1, 4, 8 and 16 MiB, each cold;
#                         KIND-freshsweep.json); every other arm's ratio to
#                         it, per round, is the table's first figure
#        safetensors      arm.py safetensors: safetensors.torch.load_file per shard
#        safetensors09    the same with safetensors 0.9 (its own venv,
#                         benches/peers/venv-st09.sh: SAFETENSORS_09)
#        runai            arm.py runai: runai_model_streamer.SafetensorsStreamer,
#                         its defaults
#        fastsafetensors  arm.py fastsafetensors: SafeTensorsFileLoader, nogds=True
#        ws-py-load       the Python module's load (arm.py), the module
#                         built from this tree into the venv
#        ws-py-safeopen   (in ARMS only) the module's safe_open +
#                         get_tensor; weightstream-reused and
#                         weightstream-faulted above are in ARMS only too
#      each run's JSON in OUT/KIND-ARM-ROUND.json (its stderr beside it in
#      .err when there is any). An arm that fails is recorded (OUT/failures.txt,
#      its stderr kept) and the run goes on. In an arm's first successful
#      round it also hashes every tensor it holds (after its clock stopped)
#      and the script checks every digest equals the reference's: a mismatch
#      stops the run (exit 1) with the differing lines
#      Each round also runs fio's best configuration of step 3 alone and one
#      fault-in (load-ceiling --fio-config BEST --fault-rounds 1, in
#      KIND-roundceiling-ROUND.json): the round's own load ceiling, so every
#      arm's ratio is to a ceiling measured beside it (median of the rounds'
#      ratios), not to the best of many noisy samples
#   5. the load ceiling again (KIND-ceiling-1.json); the better of the two
#      sweeps is reported too (the sweep's best, biased up by its many tries)
# Then benches/peers-table.py OUT: OUT/table.md, OUT/summary.json and one
# chart per kind (OUT/KIND-gbps.svg: median GB/s per arm, the line at the
# load ceiling).
#
# Arms' timed regions: weightstream load's, from before the model's headers
# are read to the last payload in memory; arm.py's, from before the shard
# list is read and the loader constructed until one byte of every page of
# every tensor it holds has been read (see arm.py). Imports are outside.
#
# Environment: KINDS, ROUNDS, SIZE (bytes, default 1.91e9), OUT_DIR as the
# first argument (default docs/benchmarks/DATE-peers), WS_BIN (a built
# weightstream; default: cargo build --release, target/release/weightstream),
# WS_BEFORE_BIN (an older build's binary: its `load` runs as the arm
# weightstream-before),
# ARMS (a subset of the arms above, space separated), WS_PEERS_VENV (the arms' venv, made by benches/peers/venv.sh when
# missing), ARM_TIMEOUT (seconds per arm run, default 900), WARMUP (1, or 0
# for none), KEEP_PAGE_REPORTING=1 (leave free page reporting as it is).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
# shellcheck source=benches/machine.sh
. benches/machine.sh   # $simdrives, cold, machine_*, write_meta
kinds=${KINDS:-memloop zram}
rounds=${ROUNDS:-5}
size=${SIZE:-1.91e9}
arm_timeout=${ARM_TIMEOUT:-900}
out=${1:-docs/benchmarks/$(date +%F)-peers}
# ARMS: a subset of the arms, space separated (default all of them).
read -r -a arms <<< "${ARMS:-weightstream fresh-read safetensors safetensors09 runai fastsafetensors ws-py-load}"
# WS_BEFORE_BIN: another build's `weightstream load` as one more arm (a
# before/after in the same interleaved run).
[ -z "${WS_BEFORE_BIN:-}" ] || arms+=(weightstream-before)

if [ "$(id -u)" != 0 ]; then echo "peers: SKIP: needs root (simdrives, drop_caches, hugetlb pool)"; exit 0; fi
if [ -n "${WS_BIN:-}" ]; then
    ws=$WS_BIN
else
    cargo build --release --quiet -p weightstream-cli
    ws=$root/target/release/weightstream
fi
"$ws" load-ceiling --help >/dev/null 2>&1 || { echo "peers: $ws has no load-ceiling command" >&2; exit 1; }
py=$(benches/peers/venv.sh)
py09=
[[ " ${arms[*]} " != *" safetensors09 "* ]] || py09=$(benches/peers/venv-st09.sh)
# The Python module's arms (ws-py-load, ws-py-safeopen) run this tree's
# module: built and installed into the venv (the workspace's target folder,
# release, as the command's arm).
if [[ " ${arms[*]} " == *" ws-py-"* ]]; then
    CARGO_TARGET_DIR=$root/target "$py" -m pip install --quiet --force-reinstall --no-deps ./python
fi
# The least a loader can do (benches/peers/fresh_read.c): built here.
fresh_read=$(mktemp -d)/fresh_read
cc -O2 -pthread -o "$fresh_read" benches/peers/fresh_read.c
mkdir -p "$out"
out=$(cd "$out" && pwd)
# Our own base and cgroup: another run's drives are left alone.
export SIMDRIVES_BASE=/tmp/ws-peers-bench SIMDRIVES_CGROUP=ws-peers-bench

machine_save
drives_down() {
    # simdrives keeps to the base we name: another run's drives stay.
    "$simdrives" down >/dev/null 2>&1 || true
}
cleanup() {
    drives_down
    machine_restore
}
trap cleanup EXIT
cleanup
machine_quiet

# Every free page touched once with reporting off: a page this VM reported
# to its host before comes back as a slow first touch (0.59 GB/s measured,
# against 20-40 GB/s for a page the host still backs), whichever arm or
# ceiling part meets it first. Bare metal skips this.
if [ -n "$old_reporting" ] && [ "${KEEP_PAGE_REPORTING:-0}" != 1 ] && [ "${WARM_MEMORY:-1}" = 1 ]; then
    cold
    avail=$(( $(awk '/MemAvailable/ {print $2}' /proc/meminfo) * 1024 ))
    warm=$(( avail - (6 << 30) ))  # room left for the drives (memloop, zram) and the loads
    if [ "$warm" -gt 0 ]; then
        t=$SECONDS
        python3 -c 'import mmap, sys
n = int(sys.argv[1]); m = mmap.mmap(-1, n)
for off in range(0, n, 1 << 30):
    k = min(1 << 30, n - off); m[off:off + k] = bytes(k)' "$warm"
        echo "warmed $((warm >> 20)) MiB of free memory in $((SECONDS - t)) s"
    fi
fi

# What this run was: enough to read the record and to rerun it.
write_meta "$out/meta.json" weightstream="$ws" weightstream_version="$("$ws" --version 2>/dev/null || true)" \
    python="$py" kinds@="$kinds" rounds:="$rounds" size:="$size" arms@="${arms[*]}" simdrives="$simdrives"

# One arm, one round: its JSON to OUT/KIND-ARM-ROUND.json; 0 when it
# succeeded. With a digest file, the arm writes its digests there.
run_arm() {
    local kind=$1 arm=$2 r=$3 digest=${4:-} base=$out/$kind-$arm-$r rc=0
    local cmd
    case $arm in
        weightstream) cmd=("$ws" load "$dir" --json ${digest:+--digest}) ;;
        weightstream-reused) cmd=("$ws" load "$dir" --json --memory reused ${digest:+--digest}) ;;
        weightstream-faulted) cmd=("$ws" load "$dir" --json --memory faulted ${digest:+--digest}) ;;
        weightstream-before) cmd=("$WS_BEFORE_BIN" load "$dir" --json ${digest:+--digest}) ;;
        fresh-read) cmd=("$fresh_read" -b "$fresh_block" "$fresh_threads" 1 "${shards[@]}") ;;
        safetensors09) cmd=("$py09" benches/peers/arm.py "$arm" "$dir" ${digest:+--digest "$digest"}) ;;
        *) cmd=("$py" benches/peers/arm.py "$arm" "$dir" ${digest:+--digest "$digest"}) ;;
    esac
    cold
    timeout "$arm_timeout" "${cmd[@]}" > "$base.json" 2> "$base.err" || rc=$?
    [ -s "$base.err" ] || rm -f "$base.err"
    if [ "$rc" != 0 ] || ! python3 -c 'import json,sys; v=json.load(open(sys.argv[1])); assert v["gbps"] > 0' "$base.json" 2>/dev/null; then
        [ "$rc" != 0 ] || rc=bad-json
        mv "$base.json" "$base.failed.json" 2>/dev/null || true
        echo "$kind $arm $r rc=$rc ${cmd[*]}" >> "$out/failures.txt"
        echo "  round $r $arm FAILED (rc $rc): $(tail -n 3 "$base.err" 2>/dev/null | tr '\n' ' ')"
        return 1
    fi
    if [ -n "$digest" ] && [[ $arm == weightstream* ]]; then
        python3 -c '
import json, sys
v = json.load(open(sys.argv[1]))
with open(sys.argv[2], "w") as f:
    f.writelines(f"{h}  {n}\n" for n, h in sorted(v["tensors_sha256"].items()))' "$base.json" "$digest"
    fi
    python3 -c '
import json, sys
v = json.load(open(sys.argv[1]))
over = v.get("peak_rss_over_baseline_bytes", v["peak_rss_bytes"] - v.get("rss_start_bytes", 0))
print("  round %s %-16s %6.3f GB/s  %6.3f s  peak RSS over start %.3fx model  CPU %.3f s/GB"
      % (sys.argv[2], sys.argv[3], v["gbps"], v["seconds"], over / v["bytes"], v["cpu_seconds_per_gb"]))' "$base.json" "$r" "$arm"
}

ceiling() { # kind index
    cold
    if ! timeout "$arm_timeout" "$ws" load-ceiling "$dir" --json > "$out/$1-ceiling-$2.json" 2> "$out/$1-ceiling-$2.err"; then
        mv "$out/$1-ceiling-$2.json" "$out/$1-ceiling-$2.failed.json"
        echo "$1 ceiling $2 failed" >> "$out/failures.txt"
        echo "  load ceiling $2 FAILED: $(tail -n 3 "$out/$1-ceiling-$2.err" | tr '\n' ' ')"
        return 0
    fi
    [ -s "$out/$1-ceiling-$2.err" ] || rm -f "$out/$1-ceiling-$2.err"
    python3 -c '
import json, sys
v = json.load(open(sys.argv[1]))
print("  load ceiling %.3f GB/s (%s bound; fio %.3f, fault %.3f GB/s)"
      % (v["gbps"], v["bound"], v["fio"]["gbps"], v["fault"]["gbps"]))' "$out/$1-ceiling-$2.json"
}

for kind in $kinds; do
    case $kind in
        memloop|zram) ;;
        *) echo "unknown kind $kind (memloop or zram)" >&2; exit 2 ;;
    esac
    mapfile -t mnts < <("$simdrives" up 1 --kind "$kind" --size 4)
    dir=${mnts[0]}/model
    "$py" benches/peers/write_model.py "$dir" --bytes "$size"
    sync
    "$py" benches/peers/arm.py digest-reference "$dir" --digest "$out/$kind-reference.sha256" > "$out/$kind-reference.json"
    echo "== $kind: $(du -sh "$dir" | cut -f1) in $dir, $(wc -l < "$out/$kind-reference.sha256") tensors"
    if [ "${WARMUP:-1}" = 1 ]; then cold; "$ws" load "$dir" > /dev/null; fi
    ceiling "$kind" 0
    # fio's best configuration of that sweep, measured again in every round
    # beside the loaders: a ceiling that is the best of many noisy samples
    # is biased up, a median of interleaved runs is not.
    best=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["fio"]["best_label"])' "$out/$kind-ceiling-0.json" 2>/dev/null || true)
    mapfile -t shards < <(ls "$dir"/*.safetensors)
    # The bare read's configuration: the best of a small sweep, each cold.
    fresh_threads=8 fresh_block=$((4 << 20))
    if [[ " ${arms[*]} " == *" fresh-read "* ]]; then
        bare_read_sweep "$out/$kind-freshsweep.json" "$fresh_read" -- "${shards[@]}"
    fi
    declare -A verified=([fresh-read]=none)  # files' bytes, not tensors: nothing to hash
    for r in $(seq 1 "$rounds"); do
        k=$(( (r - 1) % ${#arms[@]} ))
        order=("${arms[@]:k}" "${arms[@]:0:k}")
        if [ -n "$best" ]; then
            cold
            if timeout "$arm_timeout" "$ws" load-ceiling "$dir" --fio-config "$best" --fault-rounds 1 --json \
                > "$out/$kind-roundceiling-$r.json" 2> "$out/$kind-roundceiling-$r.err"; then
                rm -f "$out/$kind-roundceiling-$r.err"
                python3 -c '
import json, sys
v = json.load(open(sys.argv[1]))
print("  round %s fio (%s) %.3f GB/s, fault-in %.3f GB/s" % (sys.argv[2], v["fio"]["best_label"], v["fio"]["gbps"], v["fault"]["gbps"]))' "$out/$kind-roundceiling-$r.json" "$r"
            else
                mv "$out/$kind-roundceiling-$r.json" "$out/$kind-roundceiling-$r.failed.json"
                echo "$kind roundceiling $r failed" >> "$out/failures.txt"
            fi
        fi
        for arm in "${order[@]}"; do
            digest=
            [ -n "${verified[$arm]:-}" ] || digest=$out/$kind-$arm.sha256
            run_arm "$kind" "$arm" "$r" "$digest" || continue
            if [ -n "$digest" ]; then
                if ! cmp -s "$digest" "$out/$kind-reference.sha256"; then
                    echo "peers: DIGEST MISMATCH on $kind: $arm's tensors (round $r) are not the model's:" >&2
                    diff "$out/$kind-reference.sha256" "$digest" | head -n 20 >&2 || true
                    exit 1
                fi
                verified[$arm]=$r
                echo "  round $r $arm: every tensor's sha256 equals the reference's ($(wc -l < "$digest") tensors)"
            fi
        done
    done
    for arm in "${arms[@]}"; do
        [ -n "${verified[$arm]:-}" ] || echo "  $arm: no successful run, its bytes were never checked" | tee -a "$out/failures.txt"
    done
    unset verified
    ceiling "$kind" 1
    drives_down
done

python3 benches/peers-table.py "$out"

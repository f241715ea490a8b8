#!/usr/bin/env bash
# Interleaved A/B of `weightstream load` variants on one model, each round
# led by fio's run on the same files: medians of each variant's per-round
# ratio to that fio run (the figures of docs/benchmarks/2026-12-02-load-ceiling's
# "candidates measured").
#
#   benches/load-ab.sh MODEL_DIR ROUNDS "ARGS A" "ARGS B" ...   (root)
#
# An argument that starts with @BIN: runs that binary instead of
# target/release/weightstream ("@/tmp/before/weightstream --memory reused").
# FIO_ARGS (default: read, 4 MiB, depth 16, force_async, fixedbufs, shmhuge).
# fio runs twice after the round's cold cache: its first pass is what a
# load into fresh memory is judged against; its second pass (the files'
# second read after the cold step) is what `--memory reused` is judged
# against, whose timed load is also the second read after the cold step
# (on memloop the second read after drop_caches is slower for every reader:
# docs/benchmarks/2026-12-02-decode-rerun).
# Each run's output is parsed after its process ends (a parser started
# beside a load takes CPU from it).
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "load-ab: SKIP: needs root (drop_caches)"; exit 0; }
dir=${1:?model dir}
rounds=${2:?rounds}
shift 2
fio_args=${FIO_ARGS:---ioengine=io_uring --direct=1 --rw=read --bs=4M --iodepth=16 --numjobs=1 --force_async=1 --fixedbufs=1 --iomem=shmhuge}
files=$(ls "$dir"/*.safetensors | tr '\n' ':' | sed 's/:$//')
tmp=$(mktemp -d)
out=$tmp/rows
# shellcheck source=benches/machine.sh
. benches/machine.sh
machine_save
trap machine_restore EXIT
machine_quiet
for r in $(seq 1 "$rounds"); do
    cold
    # shellcheck disable=SC2086
    fio $fio_args --name=ab --filename="$files" --output-format=json > "$tmp/one.json" 2>/dev/null
    python3 -c 'import json,sys; j=json.load(open(sys.argv[1]))["jobs"][0]["read"]; print("F\t%.6f" % (j["io_bytes"] / j["bw_bytes"]))' "$tmp/one.json" >> "$out"
    # shellcheck disable=SC2086
    fio $fio_args --name=ab --filename="$files" --output-format=json > "$tmp/one.json" 2>/dev/null
    python3 -c 'import json,sys; j=json.load(open(sys.argv[1]))["jobs"][0]["read"]; print("F2\t%.6f" % (j["io_bytes"] / j["bw_bytes"]))' "$tmp/one.json" >> "$out"
    i=0
    for a in "$@"; do
        bin=target/release/weightstream
        if [[ $a == @* ]]; then
            bin=${a%% *}; bin=${bin#@}
            [[ $a == *" "* ]] && a=${a#* } || a=""
        fi
        cold
        # shellcheck disable=SC2086
        "$bin" load "$dir" $a --json > "$tmp/one.json" 2>/dev/null
        python3 -c 'import json,sys; v=json.load(open(sys.argv[1])); print("%s\t%.6f\t%d\t%.4f" % (sys.argv[2], v["seconds"], v["bytes"], v["cpu_seconds"]))' "$tmp/one.json" "$i" >> "$out"
        i=$((i + 1))
    done
done
python3 - "$out" "$@" <<'PY'
import statistics as st, sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1])]
arms = sys.argv[2:]
rounds, cur = [], None
for r in rows:
    if r[0] == "F":
        cur = {"F": float(r[1])}
        rounds.append(cur)
    elif r[0] == "F2":
        cur["F2"] = float(r[1])
    else:
        cur[r[0]] = (float(r[1]), int(r[2]), float(r[3]))
f = [r["F"] for r in rounds]
f2 = [r["F2"] for r in rounds]
print(f"fio: median {st.median(f):.4f} s over {len(f)} rounds; its second pass {st.median(f2):.4f} s")
for i, a in enumerate(arms):
    k = str(i)
    v = [(r["F"], r[k]) for r in rounds if k in r]
    if not v:
        continue
    ratio = [fs / s for fs, (s, _, _) in v]
    ratio2 = [r["F2"] / r[k][0] for r in rounds if k in r]
    secs = [s for _, (s, _, _) in v]
    gb = v[0][1][1] / 1e9
    print(f"{a or '(defaults)':50} median {st.median(secs):.4f} s = {gb / st.median(secs):.2f} GB/s; "
          f"x fio, same round: median {st.median(ratio):.3f} [{min(ratio):.2f}-{max(ratio):.2f}], "
          f"x its second pass {st.median(ratio2):.3f} [{min(ratio2):.2f}-{max(ratio2):.2f}]; "
          f"CPU {st.median(c for _, (_, _, c) in v) / gb:.3f} s/GB")
PY
rm -rf "$tmp"

#!/usr/bin/env bash
# The wheel against a source build (issue 50): install time and load speed.
#   1. ci/wheel --no-vllm builds and checks dist/'s wheel;
#   2. two fresh venvs with numpy: one gets the wheel (pip install, timed),
#      the other `pip install ./python` from an empty target folder (timed:
#      what a user without the wheel waits);
#   3. the 1.85 GB BF16 model (benches/peers/write_model.py) on one memloop
#      drive; ROUNDS interleaved cold rounds (the order alternating), each
#      the native whole-model load weightstream.load makes
#      (benches/wheel/ws_load.py: GB/s and CPU s/GB), after one warm-up.
# Usage: benches/wheel/bench.sh OUT_DIR    (ROUNDS, default 16)
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
out=$1
rounds=${ROUNDS:-16}
mkdir -p "$out"
source benches/machine.sh
ci/wheel --no-vllm >"$out/ci-wheel.log" 2>&1
wheel=$(ls dist/weightstream-*-cp39-abi3-manylinux_2_28_x86_64.whl)
work=$(mktemp -d /var/tmp/ws-wheel-bench.XXXXXX)
trap 'rm -rf "$work"' EXIT
for v in wheel source; do
    python3 -m venv "$work/$v"
    "$work/$v/bin/pip" install --quiet numpy
done
ms() { echo $(( ($(date +%s%N) - $1) / 1000000 )); }
t0=$(date +%s%N)
"$work/wheel/bin/pip" install --quiet --no-deps "$wheel"
wheel_ms=$(ms "$t0")
t0=$(date +%s%N)
CARGO_TARGET_DIR=$work/empty-target "$work/source/bin/pip" install --quiet ./python
source_ms=$(ms "$t0")
rm -rf "$work/empty-target"
echo "install: wheel $wheel_ms ms, source $source_ms ms"
py=$(benches/vllm/venv.sh)
machine_take ws-wheel-bench
trap 'machine_give_back; rm -rf "$work"' EXIT
mnt=$("$simdrives" up 1 --kind memloop --size 3 | tail -1)
"$py" benches/peers/write_model.py "$mnt/model" --bytes 1.91e9 >/dev/null
sync
"$work/source/bin/python" benches/wheel/ws_load.py "$mnt/model" >/dev/null
: >"$out/rounds.jsonl"
for r in $(seq 1 "$rounds"); do
    if ((r % 2)); then order="wheel source"; else order="source wheel"; fi
    for v in $order; do
        cold
        "$work/$v/bin/python" benches/wheel/ws_load.py "$mnt/model" | tee -a "$out/rounds.jsonl"
    done
done
write_meta "$out/meta.json" wheel="$(basename "$wheel")" wheel_bytes:="$(stat -c %s "$wheel")" \
    install_wheel_ms:="$wheel_ms" install_source_ms:="$source_ms" rounds:="$rounds" drive=memloop
python3 - "$out/rounds.jsonl" <<'PY' | tee "$out/summary.txt"
import json, statistics as st, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
by = {b: [r for r in rows if r["build"] == b] for b in ("wheel", "source")}
for b, rs in by.items():
    g = [r["gbps"] for r in rs]
    print(f"{b}: {len(g)} rounds, median {st.median(g):.3f} GB/s (range {min(g):.3f}-{max(g):.3f}), CPU {st.median(r['cpu_s_per_gb'] for r in rs):.3f} s/GB")
pairs = list(zip(by["wheel"], by["source"]))
g = [w["gbps"] / s["gbps"] for w, s in pairs]
c = [w["cpu_s_per_gb"] / s["cpu_s_per_gb"] for w, s in pairs]
print(f"per round, wheel / source: GB/s median {st.median(g):.3f} (wheel ahead in {sum(x > 1 for x in g)} of {len(g)}), CPU median {st.median(c):.3f} (wheel lower in {sum(x < 1 for x in c)})")
PY

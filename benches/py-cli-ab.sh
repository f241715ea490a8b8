#!/usr/bin/env bash
# The Python module's whole-model load against the command's, alone:
# `weightstream load MODEL --json` and `benches/peers/arm.py ws-py-load
# MODEL` (torch imported before its clock starts, as in benches/peers.sh),
# each after drop_caches, ROUNDS rounds, the order alternating (odd rounds
# Python first). Prints "round arm GB/s" lines, then the medians.
#
# Usage (root): benches/py-cli-ab.sh MODEL_DIR [ROUNDS]
# Environment: WS (the command; default target/release/weightstream),
# PY (a Python with torch and this tree's module; default the peers' venv).
set -euo pipefail
cd "$(dirname "$0")/.."
model=$1
rounds=${2:-10}
ws=${WS:-target/release/weightstream}
py=${PY:-$(benches/peers/venv.sh)}
gbps() { "$py" -c 'import json, sys; print(json.load(sys.stdin)["gbps"])'; }
out=$(mktemp)
for i in $(seq 1 "$rounds"); do
    if [ $((i % 2)) = 1 ]; then order="py cli"; else order="cli py"; fi
    for a in $order; do
        sync
        echo 3 > /proc/sys/vm/drop_caches
        if [ "$a" = cli ]; then
            g=$("$ws" load "$model" --json | gbps)
        else
            g=$("$py" benches/peers/arm.py ws-py-load "$model" 2>/dev/null | gbps)
        fi
        echo "$i $a $g" | tee -a "$out"
    done
done
"$py" - "$out" <<'PY'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    i, arm, g = line.split()
    runs.setdefault(arm, {})[int(i)] = float(g)
py, cli = runs["py"], runs["cli"]
ratios = [py[i] / cli[i] for i in py if i in cli]
second = sum((py[i] > cli[i]) == (i % 2 == 0) for i in py if i in cli)
print(f"median GB/s: python {statistics.median(py.values()):.3f}, command {statistics.median(cli.values()):.3f}"
      f" ({statistics.median(py.values()) / statistics.median(cli.values()):.3f}); median per-round ratio {statistics.median(ratios):.3f};"
      f" the arm run second was faster in {second} of {len(ratios)} rounds")
PY
rm -f "$out"

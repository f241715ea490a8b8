#!/usr/bin/env bash
# The quick check recorded here (not benches/vllm/bench.sh's full sweep):
# the machine's own disk (ext4 on virtio), a 0.53 GB Llama-shaped BF16
# checkpoint (benches/peers/write_model.py --bytes 6e8), cold cache before
# every arm, ROUNDS rounds, order rotating, free page reporting off.
#   docs/benchmarks/2026-12-06-vllm-plan/run.sh MODEL_DIR OUT_DIR
set -euo pipefail
cd "$(dirname "$0")/../../.."
py=${WS_VLLM_VENV:-/var/cache/weightstream/vllm-venv}/bin/python
model=$1; out=$2; rounds=${ROUNDS:-3}
mkdir -p "$out"
old=$(cat /sys/module/page_reporting/parameters/page_reporting_order)
echo 11 > /sys/module/page_reporting/parameters/page_reporting_order
trap 'echo "$old" > /sys/module/page_reporting/parameters/page_reporting_order' EXIT
arms=(auto plan noplan ws-load)
for r in $(seq 1 "$rounds"); do
  for i in "${!arms[@]}"; do
    a=${arms[$(( (i + r) % ${#arms[@]} ))]}
    sync; echo 3 > /proc/sys/vm/drop_caches
    case $a in
      auto) "$py" benches/vllm/arm.py vllm auto "$model" ;;
      plan) "$py" benches/vllm/arm.py vllm weightstream "$model" ;;
      noplan) WS_VLLM_EXTRA='{"plan": false}' "$py" benches/vllm/arm.py vllm weightstream "$model" ;;
      ws-load) "$py" benches/vllm/arm.py ws-load "$model" ;;
    esac 2>"$out/stderr-$a-$r.txt" | sed "s/^{/{\"round\": $r, \"which\": \"$a\", /" >> "$out/runs.jsonl"
  done
done

#!/usr/bin/env bash
# Does faulting in fresh memory slow the read, and by how much? fio
# (time-based, O_DIRECT, the files of the peers' reference model, 2 s) and
# a fault-in loop (benches/contention/faultloop.c: 256 MiB mappings, THP,
# MADV_POPULATE_WRITE, unmapped, on NT threads), each alone and then both
# at once, per round. Prints each rate alone and together, and the sum of
# the two shares (together / alone): 1 means the two use one resource
# (they cannot overlap), 2 that they are independent.
#
#   benches/contention/run.sh            (root: simdrives, drop_caches)
# Environment: KIND (memloop or zram, default memloop), ROUNDS (5), NT (2).
set -euo pipefail
cd "$(dirname "$0")/../.."
[ "$(id -u)" = 0 ] || { echo "contention: SKIP: needs root"; exit 0; }
. benches/machine.sh
export SIMDRIVES_BASE=/tmp/ws-contention SIMDRIVES_CGROUP=ws-contention
sd=$simdrives
py=$(benches/peers/venv.sh)
tmp=$(mktemp -d)
cc -O2 -pthread -o "$tmp/faultloop" benches/contention/faultloop.c
machine_save
trap '"$sd" down >/dev/null 2>&1 || true; machine_restore; rm -rf "$tmp"' EXIT
machine_quiet
kind=${KIND:-memloop}
mnt=$("$sd" up 1 --kind "$kind" --size 4)
dir=$mnt/model
"$py" benches/peers/write_model.py "$dir" --bytes 1.91e9 > /dev/null
sync
files=$(ls "$dir"/*.safetensors | tr '\n' ':' | sed 's/:$//')
fio_args=(--ioengine=io_uring --direct=1 --rw=read --bs=4M --iodepth=16 --numjobs=1 --force_async=1
          --fixedbufs=1 --iomem=shmhuge --time_based --runtime=2 --name=c "--filename=$files" --output-format=json)
rate() { python3 -c 'import json, sys; j = json.load(sys.stdin)["jobs"][0]["read"]; print("%.3f" % (j["bw_bytes"] / 1e9))'; }
for r in $(seq 1 "${ROUNDS:-5}"); do
    cold; alone_read=$(fio "${fio_args[@]}" 2> /dev/null | rate)
    alone_fault=$("$tmp/faultloop" 2 "${NT:-2}")
    cold
    "$tmp/faultloop" 2.2 "${NT:-2}" > "$tmp/fault" & pid=$!
    both_read=$(fio "${fio_args[@]}" 2> /dev/null | rate)
    wait "$pid"; both_fault=$(cat "$tmp/fault")
    python3 -c '
import sys
r, a, b, c, d = sys.argv[1], *map(float, sys.argv[2:])
print(f"round {r}: alone read {a:.2f}, fault {b:.2f} GB/s; together read {c:.2f}, fault {d:.2f}; shares {c/a:.2f} + {d/b:.2f} = {c/a + d/b:.2f}")' \
        "$r" "$alone_read" "$alone_fault" "$both_read" "$both_fault"
done

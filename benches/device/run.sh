#!/usr/bin/env bash
# The device check, run ON a GPU machine when one is lent (it has python3
# with a CUDA torch, transformers and safetensors, no Rust, no fio, no
# network). Prepared here by benches/device/prepare.sh, which puts the
# weightstream wheel and a static fio into .device/ (ignored by git).
#
#   run(command="bash benches/device/run.sh", carry=[".device"], timeout_s=480)
#
# What it does, in about 3-4 minutes on an H200 machine, writing under
# $OUT (default /tmp/ws-device-out):
# 1. installs the wheel into /tmp/site (no deps, no network);
# 2. writes a Llama-shaped bf16 checkpoint of SIZE bytes (default 4e9)
#    with transformers on the machine's own disk (gpu_load_into.py write);
# 3. the drive's ceiling for those files: fio (io_uring, O_DIRECT,
#    registered buffers, force_async) over a small sweep of block size x
#    queue depth, cold cache, the best kept (fio.json, fio-ceiling.txt);
# 4. ROUNDS rounds (default 3) of gpu_load_into.py run on cuda:
#    h2d, load-into, ws-load-lsd, st-load-lsd, st09-prefetch, ws-load,
#    vllm-plan, vllm-loader (the vLLM-shaped case: vllm_shaped.py)
#    (device.json);
# 5. the machine as seen (machine.txt: nvidia-smi, lscpu, the mounts, the
#    kernel), and the log (log.txt).
# Record the files in docs/benchmarks/<date>-device/ with a README (the
# figures as ratios: load-into / h2d, load-into / fio, load-into / ws-load).
#
# DEVICE=cpu runs the same steps with torch on the CPU (a dry run here:
# every line but the CUDA ones); SIZE, ROUNDS, WS_DEVICE_DIR (the folder
# for the checkpoint, default /tmp/ws-device-model) change the rest.
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
out=${OUT:-/tmp/ws-device-out}
size=${SIZE:-4e9}
rounds=${ROUNDS:-3}
device=${DEVICE:-cuda}
dir=${WS_DEVICE_DIR:-/tmp/ws-device-model}
py=${PYTHON:-python3}
mkdir -p "$out"
exec > >(tee "$out/log.txt") 2>&1

echo "== machine"
{
    date -Is; uname -a; nproc; free -g
    nvidia-smi 2>&1 | head -20
    lscpu 2>&1 | head -20
    findmnt -T /tmp 2>&1
    cat /proc/sys/vm/drop_caches >/dev/null 2>&1 && echo "drop_caches readable"
} > "$out/machine.txt" 2>&1
head -5 "$out/machine.txt"

echo "== wheel"
if ls .device/weightstream-*.whl >/dev/null 2>&1; then
    # With safetensors 0.9 beside it (its prefetch engine is an arm; its
    # load_file reads as 0.8's).
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .device/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    # The libraries the extension links beyond glibc (hwloc, udev).
    export LD_LIBRARY_PATH=$root/.device/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
"$py" -c 'import weightstream, torch, safetensors; print("weightstream", weightstream.__version__, "torch", torch.__version__, "safetensors", safetensors.__version__, "cuda", torch.cuda.is_available())' || exit 1

echo "== checkpoint ($size bytes) in $dir"
if [ ! -f "$dir/config.json" ] || ! ls "$dir"/*.safetensors >/dev/null 2>&1; then
    rm -rf "$dir"
    "$py" benches/device/gpu_load_into.py write "$dir" "$size" || exit 1
fi
sync

echo "== fio"
fio=$(command -v fio || true)
[ -x .device/fio ] && fio=$root/.device/fio
if [ -n "$fio" ]; then
    files=$(ls "$dir"/*.safetensors | paste -sd: -)
    best=0
    : > "$out/fio.json"
    # One cold fio run: LABEL, then fio's own options; its GB/s raises $best.
    fio_one() {
        local label=$1 f=$out/fio-run
        shift
        sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null
        if ! "$fio" --name=ceiling --filename="$files" --readonly --rw=read --direct=1 "$@" \
            --output-format=json > "$f.json" 2> "$f.err"; then
            echo "fio $label failed: $(tail -2 "$f.err")"
            rm -f "$f".*
            return 0
        fi
        gbps=$("$py" -c 'import json,sys; j=json.load(open(sys.argv[1])); print(j["jobs"][0]["read"]["bw_bytes"]/1e9)' "$f.json")
        echo "fio $label: $gbps GB/s"
        best=$("$py" -c "print(max($best, $gbps))")
        cat "$f.json" >> "$out/fio.json"
        rm -f "$f".*
    }
    for bs in 1M 4M; do
        for qd in 8 32; do
            fio_one "io_uring bs $bs qd $qd" --bs=$bs --iodepth=$qd --ioengine=io_uring --fixedbufs=1 --force_async=1 --numjobs=1
        done
    done
    # A kernel without io_uring (gVisor refuses it): the ceiling from
    # psync O_DIRECT readers instead, said so in the file.
    engine=io_uring
    if [ "$best" = 0 ]; then
        engine=psync
        for bs in 1M 4M; do
            for jobs in 4 8; do
                fio_one "psync bs $bs jobs $jobs" --bs=$bs --numjobs=$jobs --ioengine=psync --group_reporting
            done
        done
    fi
    echo "$best $engine" > "$out/fio-ceiling.txt"
    echo "fio best: $best GB/s ($engine)"
else
    echo "no fio: run benches/device/prepare.sh here first (it builds .device/fio)"
fi

echo "== rounds"
"$py" benches/device/gpu_load_into.py run "$dir" "$out/device.json" --device "$device" --rounds "$rounds"
rc=$?
ls -la "$out"
exit $rc

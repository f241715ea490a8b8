#!/usr/bin/env bash
# Prints the python of the peer loaders' venv (benches/peers.sh's arms run
# in it), making the venv first only when it lacks one of the packages.
#
#   benches/peers/venv.sh            -> /var/cache/weightstream/peers-venv/bin/python
#
# WS_PEERS_VENV: the venv's directory (default /var/cache/weightstream/peers-venv).
# WS_PEERS_PIP_ARGS: extra `pip install` arguments (e.g. an index for a
# CPU-only torch), used only when the venv is made or completed.
#
# The check imports torch, safetensors, numpy, runai_model_streamer,
# fastsafetensors, pytest and transformers; when all import, nothing is
# installed and only the path is printed (idempotent, quiet). Otherwise
# `python3 -m venv` (if there is no venv yet) and `pip install torch
# safetensors numpy runai-model-streamer fastsafetensors pytest
# transformers`, their output on stderr. Versions are not pinned: every
# arm's JSON records the versions it ran with. (ci/python's tests run in
# the pinned venv of benches/vllm/venv.sh.)
set -euo pipefail
dir=${WS_PEERS_VENV:-/var/cache/weightstream/peers-venv}
py=$dir/bin/python
pkgs=(torch safetensors numpy runai-model-streamer fastsafetensors pytest transformers)
mods="torch, safetensors, numpy, runai_model_streamer, fastsafetensors, pytest, transformers"

complete() { [ -x "$py" ] && "$py" -c "import $mods" >/dev/null 2>&1; }

if ! complete; then
    mkdir -p "$(dirname "$dir")"
    # Two runs making the same venv at once would trip over each other.
    exec 9> "$dir.lock"
    flock 9
    if ! complete; then
        echo "venv.sh: making $dir (pip install ${pkgs[*]})" >&2
        [ -x "$py" ] || python3 -m venv "$dir" >&2
        # shellcheck disable=SC2086 # WS_PEERS_PIP_ARGS is a list of words
        "$py" -m pip install --quiet --disable-pip-version-check ${WS_PEERS_PIP_ARGS:-} "${pkgs[@]}" >&2
        complete || { echo "venv.sh: $py still cannot import $mods" >&2; exit 1; }
    fi
    exec 9>&-
fi
echo "$py"

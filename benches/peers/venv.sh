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
# fastsafetensors, pytest and transformers (ci/python's tests run in this
# venv too) and checks the pinned versions; when all hold, nothing is
# installed and only the path is printed (idempotent, quiet). Otherwise
# `python3 -m venv` (if there is no venv yet) and `pip install torch
# safetensors==0.8.0 numpy runai-model-streamer fastsafetensors pytest
# transformers==5.25.0`, their output on stderr. safetensors is pinned:
# ci/python runs that release's own read tests against the drop-in (and
# the next release's as soon as one is out); transformers is pinned for
# the logits test. The rest are not: every arm's JSON records the
# versions it ran with.
set -euo pipefail
dir=${WS_PEERS_VENV:-/var/cache/weightstream/peers-venv}
py=$dir/bin/python
pkgs=(torch safetensors==0.8.0 numpy runai-model-streamer fastsafetensors pytest transformers==5.25.0)
mods="torch, safetensors, numpy, runai_model_streamer, fastsafetensors, pytest, transformers"
pins='assert safetensors.__version__ == "0.8.0" and transformers.__version__ == "5.25.0"'

complete() { [ -x "$py" ] && "$py" -c "import $mods; $pins" >/dev/null 2>&1; }

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

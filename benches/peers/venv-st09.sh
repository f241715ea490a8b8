#!/usr/bin/env bash
# Prints the python of a venv where safetensors is 0.9 (SAFETENSORS_09,
# default 0.9.0rc1, a pre-release on the package index) and everything
# else is the peers venv's (benches/peers/venv.sh): its site-packages are
# appended through a .pth file, after this venv's own, so this venv's
# safetensors shadows the 0.8 there and torch is not installed twice.
#
#   benches/peers/venv-st09.sh      -> /var/cache/weightstream/peers-venv-st09/bin/python
#
# WS_PEERS_ST09_VENV: the venv's directory.
set -euo pipefail
cd "$(dirname "$0")/../.."
version=${SAFETENSORS_09:-0.9.0rc1}
dir=${WS_PEERS_ST09_VENV:-/var/cache/weightstream/peers-venv-st09}
py=$dir/bin/python
base=$(benches/peers/venv.sh)
check() {
    [ -x "$py" ] && [ "$("$py" -c 'import torch, safetensors; from importlib.metadata import version; print(version("safetensors"))' 2>/dev/null)" = "$version" ]
}
if ! check; then
    mkdir -p "$(dirname "$dir")"
    exec 9> "$dir.lock"
    flock 9
    if ! check; then
        echo "venv-st09.sh: making $dir (safetensors==$version over $(dirname "$(dirname "$base")"))" >&2
        [ -x "$py" ] || python3 -m venv "$dir" >&2
        site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        "$base" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' > "$site/zz-peers-venv.pth"
        "$py" -m pip install --quiet --disable-pip-version-check --no-deps "safetensors==$version" >&2
        check || { echo "venv-st09.sh: $py does not give safetensors $version with torch" >&2; exit 1; }
    fi
    exec 9>&-
fi
echo "$py"

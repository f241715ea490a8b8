#!/usr/bin/env bash
# Prepares the device check (benches/device/run.sh) HERE, before a GPU
# machine is asked for: that machine has python3 with a CUDA torch,
# transformers and safetensors, but no Rust, no fio and no network.
#
#   benches/device/prepare.sh        (root: apt-get for fio's source)
#
# Puts into .device/ (ignored by git through .git/info/exclude; carry it):
# - the weightstream wheel (abi3: any CPython 3.9 or later), built from
#   this tree, and safetensors 0.9's wheel (abi3) from the package index;
# - lib/: the shared libraries the wheel links beyond glibc (hwloc, udev);
# - fio: fio built from the distribution's source, static, with only the
#   engines the ceiling uses (io_uring, psync), so that it runs there.
# About 12 MB in all (a call carries 64 MiB at most).
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
mkdir -p .device/lib
grep -qx '/.device/' .git/info/exclude 2>/dev/null || echo '/.device/' >> .git/info/exclude

py=$(benches/vllm/venv.sh)
rm -f .device/weightstream-*.whl
CARGO_TARGET_DIR=$root/target "$py" -m pip wheel --quiet --no-deps -w .device ./python
so=$(unzip -l .device/weightstream-*.whl | awk '/_native.*\.so$/ {print $4}')
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
unzip -q -o .device/weightstream-*.whl "$so" -d "$tmp"
# Every library the extension needs that a bare image may lack (glibc and
# the loader it will have).
ldd "$tmp/$so" | awk '/=>/ {print $1, $3}' | while read -r name path; do
    case $name in libc.so*|libm.so*|libgcc_s.so*|ld-linux*|libpthread.so*|libdl.so*) ;;
    *) cp -L "$path" .device/lib/ ;;
    esac
done

# safetensors 0.9 (its prefetch engine: pread into pinned slabs, copies on
# a stream) for the arm st09-prefetch; that machine has 0.8.
ls .device/safetensors-0.9*.whl >/dev/null 2>&1 ||
    "$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 -d .device "safetensors==${SAFETENSORS_09:-0.9.0rc1}"

if [ ! -x .device/fio ]; then
    src=$tmp/src
    mkdir -p "$src/parts" "$src/lists"
    # The distribution's own source entries, as deb-src, in a list of our
    # own (the system's apt configuration is left as it is).
    sed 's/^Types: deb$/Types: deb-src/' /etc/apt/sources.list.d/*.sources > "$src/parts/src.sources"
    apt=(-o Dir::Etc::SourceList=/dev/null -o Dir::Etc::SourceParts="$src/parts" -o Dir::State::Lists="$src/lists")
    apt-get "${apt[@]}" update -qq
    (cd "$src" && apt-get "${apt[@]}" source --download-only fio >/dev/null 2>&1)
    tar -C "$src" -xzf "$src"/fio_*.orig.tar.gz
    (
        cd "$src"/fio-*/
        ./configure --build-static --disable-native --disable-numa --disable-rdma --disable-rados \
            --disable-rbd --disable-http --disable-gfapi --disable-libnfs --disable-pmem \
            --disable-xnvme --disable-dfs --disable-lex --disable-libzbc --disable-tcmalloc >/dev/null
        make -j"$(nproc)" fio >/dev/null
    )
    cp "$src"/fio-*/fio .device/fio
fi
.device/fio --version
ls -la .device .device/lib
du -sh .device

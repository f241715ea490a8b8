#!/usr/bin/env bash
# Packs a benchmark record's raw per-run data into RECORD/raw.tar.xz, so
# the repository's records stay small: every file but the text (*.md), the
# charts (*.svg), meta.json and the files a *.md of the record links to
# goes into the archive, and is removed. `tar xJf raw.tar.xz` in the
# record restores them (the table scripts read them there). Running it on
# a record already packed adds only files written since.
#
# Usage: benches/pack-raw.sh RECORD_DIR...
set -euo pipefail
for d in "$@"; do
    [ -d "$d" ] || { echo "pack-raw: $d: not a directory" >&2; exit 1; }
    (
        cd "$d"
        # Files a text of the record links to stay beside it.
        linked=$(cat ./*.md 2>/dev/null | grep -o '](\([^)#]*\))' | sed 's/^](//; s/)$//' | grep -v '://' | sort -u || true)
        mapfile -t files < <(find . -type f ! -name '*.md' ! -name '*.svg' ! -name 'meta.json' ! -name 'raw.tar.xz' | sed 's#^\./##' | sort)
        keep=()
        for f in "${files[@]}"; do
            if grep -qxF "$f" <<< "$linked"; then continue; fi
            keep+=("$f")
        done
        [ "${#keep[@]}" -gt 0 ] || { echo "pack-raw: $d: nothing to pack"; exit 0; }
        if [ -f raw.tar.xz ]; then
            tmp=$(mktemp -d)
            tar xJf raw.tar.xz -C "$tmp"
            for f in "${keep[@]}"; do mkdir -p "$tmp/$(dirname "$f")"; cp "$f" "$tmp/$f"; done
            (cd "$tmp" && find . -type f | sed 's#^\./##' | sort | tar cJf raw.tar.xz --owner=0 --group=0 --mtime=@0 -T -)
            mv "$tmp/raw.tar.xz" raw.tar.xz
            rm -rf "$tmp"
        else
            printf '%s\n' "${keep[@]}" | tar cJf raw.tar.xz --owner=0 --group=0 --mtime=@0 -T -
        fi
        rm -f "${keep[@]}"
        find . -type d -empty -delete
        echo "pack-raw: $d: ${#keep[@]} file(s) into raw.tar.xz ($(du -k raw.tar.xz | cut -f1) KiB)"
    )
done

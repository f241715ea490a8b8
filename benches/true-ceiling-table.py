#!/usr/bin/env python3
"""The record's tables from benches/true-ceiling.sh's JSON files.

Usage: benches/true-ceiling-table.py OUT_DIR > OUT_DIR/table.md
Every figure is a median of the interleaved runs; ratios are to fio's best
(and the ceiling's) measured in the same runs. GB = 10^9 bytes."""
import json
import pathlib
import sys

out = pathlib.Path(sys.argv[1])
KINDS = [
    ("virtio", "the VM's virtio disk (the host caches its image: noisy)"),
    ("loop200", "a loop drive capped at 200 MB/s (simdrives, blkio throttle)"),
    ("memloop", "a fast drive that completes asynchronously (loop over /dev/shm, as NVMe DMA)"),
    ("zram1", "one fast drive that completes inline (zram: the copy runs in the submitter)"),
    ("zram2", "two zram drives, full mirror, both read at once"),
]


def load(p):
    t = p.read_text()
    return json.loads(t[t.index("{"):])


print("| drive | c | ceiling GB/s | fio best GB/s | ceiling/fio | engine GB/s | engine/fio | pread GB/s | pread/fio | engine CPU s/GB | fio CPU s/GB | engine p50 / p99 ms |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
notes = []
for kind, what in KINDS:
    for c in (8, 1):
        p = out / f"{kind}-c{c}.json"
        if not p.exists():
            continue
        r = load(p)
        a = r["arms"]
        ceil, fio = a.get("ceiling", {}), a.get("fio", {})
        eng, pr = a.get("engine", {}), a.get("pread", {})
        fio_g = fio.get("gbps") or r.get("fio_gbps") or 0
        def g(x):
            return f"{x['gbps']:.3f} ({x['gbps_min']:.2f}-{x['gbps_max']:.2f})" if x else "-"
        def rf(x):
            return f"{x['gbps'] / fio_g:.2f}" if x and fio_g else "-"
        p50 = eng.get("p50_ms")
        p99 = eng.get("p99_ms")
        print(
            f"| {kind} | {c} | {g(ceil)} | {g(fio)} | {rf(ceil)} | {g(eng)} | {rf(eng)} | {g(pr)} | {rf(pr)} | "
            f"{eng.get('cpu_s_per_gb', 0):.3f} | {fio.get('cpu_s_per_gb', 0):.3f} | "
            f"{p50 and round(p50, 2)} / {p99 and round(p99, 2)} |"
        )
        for w in r.get("warnings", []):
            notes.append(f"- {kind} c{c}: warning: {w}")
        if c == 8:
            notes.append(f"- {kind}: {what}; ceiling's best {r.get('ceiling_config')}; fio's best {r.get('fio_config')}")
    fe = out / f"{kind}-fio-expert.json"
    c1 = out / f"{kind}-c1.json"
    if fe.exists() and c1.exists():
        try:
            f = load(fe)
            r = load(c1)
            bw = sum(j["read"]["bw_bytes"] for j in f["jobs"])
            expert = r["bytes_per_run"] / r["tensors"]
            eq = expert / bw * 1e3
            eng = r["arms"]["engine"]
            notes.append(
                f"- {kind}, one expert at a time ({expert / 1e6:.1f} MB): fio with the same bytes in flight "
                f"{bw / 1e9:.3f} GB/s, i.e. {eq:.2f} ms per expert; engine p50 {eng['p50_ms']:.2f} ms "
                f"({eq / eng['p50_ms']:.2f} of fio's pace), p99 {eng['p99_ms']:.2f} ms"
            )
        except (ValueError, KeyError, ZeroDivisionError) as e:
            notes.append(f"- {kind}: fio one-expert run unreadable ({e})")
print()
print("\n".join(notes))

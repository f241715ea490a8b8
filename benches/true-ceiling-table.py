#!/usr/bin/env python3
"""The record's tables from benches/true-ceiling.sh's JSON files.

Usage: benches/true-ceiling-table.py OUT_DIR > OUT_DIR/table.md
Every figure is a median of the interleaved runs; ratios are to fio's best
(and the ceiling's) measured in the same runs. With `--sweep-figure rerun`
(bench's default) fio's and the ceiling's figure per run is the sweep's best
configuration run again alone; "per run" is the median of each run's own
engine/fio ratio, and "/ sweep max" the engine's median over the median of
the sweeps' largest figures (a maximum of 8 runs each: biased up). GB = 10^9
bytes."""
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


print("| drive | c | ceiling GB/s | fio best GB/s | ceiling/fio | engine GB/s | engine/fio | engine/fio per run | engine / fio sweep max | engine/ceiling | pread GB/s | pread/fio | engine/pread | engine CPU s/GB | fio CPU s/GB | engine p50 / p99 ms |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
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
        def per_run(x, y):
            if not x or not y:
                return "-"
            v = sorted(a["gbps"] / b["gbps"] for a, b in zip(x["runs"], y["runs"]) if b["gbps"] > 0)
            if not v:
                return "-"
            n = len(v)
            return f"{(v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2):.2f}"
        smax = r.get("fio_sweep_max_gbps")
        vs_max = f"{eng['gbps'] / smax:.2f} ({smax:.2f})" if eng and smax else "-"
        vs_ceil = f"{eng['gbps'] / ceil['gbps']:.2f}" if eng and ceil and ceil["gbps"] else "-"
        vs_pread = f"{eng['gbps'] / pr['gbps']:.2f}" if eng and pr and pr["gbps"] else "-"
        p50 = eng.get("p50_ms")
        p99 = eng.get("p99_ms")
        print(
            f"| {kind} | {c} | {g(ceil)} | {g(fio)} | {rf(ceil)} | {g(eng)} | {rf(eng)} | {per_run(eng, fio)} | {vs_max} | "
            f"{vs_ceil} | {g(pr)} | {rf(pr)} | {vs_pread} | "
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

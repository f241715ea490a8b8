#!/usr/bin/env python3
"""The load record's table, summary and charts from benches/load.sh's JSON.

Usage: load-table.py OUT_DIR "KINDS" RUNS WEIGHTSTREAM_BINARY
Medians over RUNS per arm; ratios to fio's best (the better of the sweep
run before and after the loads) and to safetensors-mmap's time.
"""
import json, statistics, subprocess, sys
out, kinds, runs, ws = sys.argv[1], sys.argv[2].split(), int(sys.argv[3]), sys.argv[4]
arms = ["weightstream", "ahead-on", "ahead-off", "populate", "prefault", "safetensors-mmap", "fs-read", "mmap"]
summary, lines = {}, []
lines.append("| drive | arm | GB/s (median) | runs | x fio best | x safetensors-mmap | total s | open + engine s | mapping s | peak RSS / model | page cache growth MB | CPU s/GB |")
lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
for kind in kinds:
    fio = max(json.load(open(f"{out}/{kind}-fio-{i}.json"))["arms"]["fio"]["gbps"] for i in (0, 1))
    per = {}
    for arm in arms:
        rs = [json.load(open(f"{out}/{kind}-{arm}-{r}.json")) for r in range(1, runs + 1)]
        med = lambda f: statistics.median(f(v) for v in rs)
        per[arm] = {
            "gbps": med(lambda v: v["gbps"]),
            "seconds": med(lambda v: v["seconds"]),
            "arena_seconds": med(lambda v: (v.get("report") or {}).get("arena_seconds", 0.0)),
            "open_seconds": med(lambda v: v["seconds"] - (v.get("report") or {}).get("seconds", v["seconds"])),
            "rss_ratio": med(lambda v: v["peak_rss_bytes"] / v["bytes"]),
            "cache_mb": med(lambda v: v["page_cache_growth_bytes"] / 1e6),
            "cpu_per_gb": med(lambda v: v["cpu_seconds_per_gb"]),
            "bytes": rs[0]["bytes"],
            "runs_gbps": [v["gbps"] for v in rs],
        }
    st = per["safetensors-mmap"]["seconds"]
    # Fresh memory: bytes faulted in per second (the populate arm's mapping).
    fault = per["populate"]["bytes"] / 1e9 / max(per["populate"]["arena_seconds"], 1e-9)
    for arm in arms:
        p = per[arm]
        p["x_fio"] = p["gbps"] / fio
        p["x_safetensors_mmap"] = st / p["seconds"]
        lines.append(
            f"| {kind} | {arm} | {p['gbps']:.3f} | {' '.join(f'{g:.2f}' for g in p['runs_gbps'])} | {p['x_fio']:.2f} | {p['x_safetensors_mmap']:.2f} | "
            f"{p['seconds']:.3f} | {p['open_seconds']:.3f} | {p['arena_seconds']:.3f} | {p['rss_ratio']:.3f} | {p['cache_mb']:+.1f} | {p['cpu_per_gb']:.3f} |"
        )
    summary[kind] = {"fio_best_gbps": fio, "fault_gbps_one_thread": fault, "arms": per}
    lines.append(f"| {kind} | fio best (sweep, before and after) | {fio:.3f} | | 1.00 | | | | | | | |")
    lines.append(f"| {kind} | fresh memory faulted in by one thread (populate's mapping) | {fault:.3f} | | | | | | | | | |")
    for what, key, unit, ref in [("gbps", "gbps", "GB/s", fio), ("rss", "rss_ratio", "peak RSS / model bytes", 1.0)]:
        spec = {
            "title": f"Whole-model load on {kind}: {'GB/s (line: fio best)' if what == 'gbps' else 'peak RSS (line: the model)'}",
            "unit": unit,
            "bars": [[a, per[a][key]] for a in arms],
            "reference": ref,
        }
        p = f"{out}/{kind}-{what}.plot.json"
        json.dump(spec, open(p, "w"))
        subprocess.run([ws, "plot", p, f"{out}/{kind}-{what}.svg"], check=True)
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
open(f"{out}/table.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))

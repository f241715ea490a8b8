#!/usr/bin/env python3
"""benches/drives-load.sh's table: per layout, the median GB/s, CPU s/GB
and peak RSS per model byte of `weightstream load` and of the bare read of
every drive at once, and the median of the per-round ratios (target 0.95).

    drives-table.py OUT_DIR      -> OUT/table.md, OUT/summary.json"""

import json
import os
import statistics
import sys


def main():
    out = sys.argv[1]
    meta = json.load(open(os.path.join(out, "meta.json")))
    lines = [
        "| layout | arm | GB/s (median) | min-max | CPU s/GB | peak RSS / model | weightstream / bare read, same round (min-max) | target 0.95 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    summary = {"meta": meta, "layouts": {}}
    for spec in meta["layouts"]:
        layout, kind, n = spec.split(":")
        name = f"{layout}-{kind}-{n}"
        runs = {}
        for arm in ("weightstream", "fresh-read"):
            for r in range(1, meta["rounds"] + 1):
                p = os.path.join(out, f"{name}-{arm}-{r}.json")
                if os.path.exists(p):
                    runs.setdefault(arm, {})[r] = json.load(open(p))
        ratios = [runs["weightstream"][r]["gbps"] / runs["fresh-read"][r]["gbps"]
                  for r in runs.get("weightstream", {}) if r in runs.get("fresh-read", {})]
        x = statistics.median(ratios) if ratios else None
        s = {"ratio_median": x, "ratios": ratios, "arms": {}}
        for arm, rs in runs.items():
            vs = list(rs.values())
            g = [v["gbps"] for v in vs]
            rss = [(v["peak_rss_bytes"] - v.get("rss_start_bytes", 0)) / v["bytes"] for v in vs]
            a = {"gbps": statistics.median(g), "min": min(g), "max": max(g),
                 "cpu_seconds_per_gb": statistics.median(v["cpu_seconds_per_gb"] for v in vs),
                 "peak_rss_per_model": statistics.median(rss), "runs": len(vs)}
            if arm == "fresh-read":
                a["threads"], a["block"], a["copies"] = vs[0]["threads"], vs[0]["block"], vs[0].get("copies", 1)
            s["arms"][arm] = a
            what = f"{arm} ({a['threads']} threads x {a['block'] >> 20} MiB)" if arm == "fresh-read" else "weightstream load"
            ratio = "" if arm == "fresh-read" or x is None else f"{x:.3f} ({min(ratios):.2f}-{max(ratios):.2f})"
            met = "" if arm == "fresh-read" or x is None else ("met" if x >= 0.95 else "**not met**")
            lines.append(f"| {n} x {kind}, {layout} | {what} | {a['gbps']:.3f} | {a['min']:.2f}-{a['max']:.2f} | "
                         f"{a['cpu_seconds_per_gb']:.3f} | {a['peak_rss_per_model']:.3f} | {ratio} | {met} |")
        summary["layouts"][spec] = s
    text = "\n".join(lines) + "\n"
    open(os.path.join(out, "table.md"), "w").write(text)
    json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
    print(text, end="")


if __name__ == "__main__":
    main()

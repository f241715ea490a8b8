#!/usr/bin/env python3
"""OUT/runs.jsonl of benches/distributed.sh -> OUT/table.md and
OUT/time.svg: per arm and world size, the median over rounds of the run's
time (its slowest rank), the ratio to ws-dist with one rank, bytes each rank
read, CPU seconds and peak RSS per rank."""

import json
import os
import statistics
import sys


def main():
    out = sys.argv[1]
    runs = [json.loads(l) for l in open(os.path.join(out, "runs.jsonl")) if l.strip()]
    meta = json.load(open(os.path.join(out, "meta.json")))
    groups = {}
    for v in runs:
        groups.setdefault((v["arm"], v["world"]), []).append(v)
    rows = []
    base = None
    for (arm, world), vs in sorted(groups.items()):
        # One run = `world` lines with the same round; the run's time is its
        # slowest rank's.
        per_run = [vs[i : i + world] for i in range(0, len(vs), world)]
        times = [max(x["seconds"] for x in run) for run in per_run]
        med = statistics.median(times)
        # Bytes read: what weightstream's report says (ws-dist), the whole
        # model for arms that read it all on every rank, none for the floor;
        # Run:ai reports none (its log says it split the reads).
        if arm == "ws-dist":
            read = statistics.median(max(x["report"]["bytes_read"] for x in run) for run in per_run)
        elif arm == "ws-each":
            read = vs[0]["bytes"]
        else:
            read = None
        cpu = statistics.median(max(x["cpu_seconds"] for x in run) for run in per_run)
        rss = statistics.median(max(x["peak_rss_bytes"] for x in run) for run in per_run)
        rows.append((arm, world, len(times), med, min(times), max(times), read, cpu, rss, vs[0]["bytes"]))
        if arm == "ws-dist" and world == 1:
            base = med
    lines = [
        f"# Loads shared across ranks ({meta['kind']}, {meta['mbps_per_rank']} MB/s per rank, {meta['size'] / 1e9:.2f} GB model)",
        "",
        "| arm | ranks | runs | seconds (median) | min-max | / ws-dist x1 | bytes read by the busiest rank | CPU s (busiest rank) | peak RSS (largest rank) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, world, n, med, lo, hi, read, cpu, rss, total in rows:
        ratio = f"{med / base:.3f}" if base else "-"
        rd = "not reported" if read is None else f"{read / 1e6:.0f} MB of {total / 1e6:.0f}"
        if arm == "gloo-floor":
            rd = "none (no reads)"
        lines.append(f"| {arm} | {world} | {n} | {med:.3f} | {lo:.3f}-{hi:.3f} | {ratio} | {rd} | {cpu:.2f} | {rss / 1e9:.2f} GB |")
    open(os.path.join(out, "table.md"), "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))
    # A plain SVG: one bar per (arm, ranks).
    w, h, pad = 640, 40 + 28 * len(rows), 200
    top = max(r[3] for r in rows) or 1
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
           f'<text x="10" y="18">seconds to a full state dict on every rank (median; {meta["mbps_per_rank"]} MB/s per rank)</text>']
    for i, (arm, world, _, med, *_rest) in enumerate(rows):
        y = 30 + 28 * i
        bw = (w - pad - 60) * med / top
        svg.append(f'<text x="10" y="{y + 15}">{arm} x{world}</text>')
        svg.append(f'<rect x="{pad}" y="{y}" width="{bw:.1f}" height="20" fill="#4878a8"/>')
        svg.append(f'<text x="{pad + bw + 5:.1f}" y="{y + 15}">{med:.2f} s</text>')
    svg.append("</svg>")
    open(os.path.join(out, "time.svg"), "w").write("\n".join(svg) + "\n")


if __name__ == "__main__":
    main()

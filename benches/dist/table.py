#!/usr/bin/env python3
"""OUT/runs.jsonl of benches/distributed.sh -> OUT/table.md and
OUT/time.svg: per arm and world size, the median over rounds of the run's
time (its slowest rank), the ratio to ws-dist with one rank, bytes each rank
read, CPU seconds and peak RSS per rank."""

import json
import os
import statistics
import sys


def targets(runs, meta):
    """Issue 38's target per world size: ws-dist's time over the larger of
    its round's two floors (the exchange alone, gloo-floor; one rank's read
    of its share, ws-share), median of the per-round ratios, at most 1.15;
    and the busiest rank's bytes read at most 1/N of the model plus the
    largest tensor."""
    by = {}
    for v in runs:
        if "round" in v:
            by.setdefault((v["arm"], v["world"], v["round"]), []).append(v)
    t = lambda arm, w, r: max(x["seconds"] for x in by[(arm, w, r)]) if (arm, w, r) in by else None
    worlds = sorted({w for (_, w, _) in by if w > 1})
    if not worlds:
        return []
    total, largest = meta.get("model_bytes"), meta.get("largest_tensor_bytes")
    lines = ["", "Targets (issue 38; medians of per-round ratios):", "",
             "| ranks | ws-dist / max(gloo-floor, ws-share), same round (min-max) | target 1.15 | busiest rank's bytes read | bound 1/N + largest | |",
             "|---|---|---|---|---|---|"]
    for w in worlds:
        rs = sorted({r for (a, ww, r) in by if a == "ws-dist" and ww == w})
        xs = []
        for r in rs:
            floors = [x for x in (t("gloo-floor", w, r), t("ws-share", w, r)) if x]
            if floors and t("ws-dist", w, r):
                xs.append(t("ws-dist", w, r) / max(floors))
        reads = [max(x["report"]["bytes_read"] for x in by[("ws-dist", w, r)]) for r in rs]
        bound = total / w + largest if total and largest else None
        x = statistics.median(xs) if xs else None
        rd = max(reads) if reads else None
        lines.append(
            f"| {w} | {'n/a' if x is None else f'{x:.3f} ({min(xs):.2f}-{max(xs):.2f})'} | {'met' if x is not None and x <= 1.15 else '**not met**'} | "
            f"{'n/a' if rd is None else f'{rd / 1e6:.0f} MB'} | {'n/a' if bound is None else f'{bound / 1e6:.0f} MB'} | "
            f"{'met' if rd is not None and bound is not None and rd <= bound else '**not met**'} |"
        )
    return lines


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
        if arm in ("ws-dist", "ws-share"):
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
        total = meta.get("model_bytes", total)
        rd = "not reported" if read is None else f"{read / 1e6:.0f} MB of {total / 1e6:.0f}"
        if arm == "gloo-floor":
            rd = "none (no reads)"
        lines.append(f"| {arm} | {world} | {n} | {med:.3f} | {lo:.3f}-{hi:.3f} | {ratio} | {rd} | {cpu:.2f} | {rss / 1e9:.2f} GB |")
    lines += targets(runs, meta)
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

#!/usr/bin/env python3
"""The MoE decode benchmark's table (benches/moe-decode/bench.sh).

    table.py OUT_DIR        OUT/table.md and OUT/summary.json

Per drive kind, expert fraction and batch: each arm's median tokens/s over
its rounds, load seconds, peak RSS and the cgroup's peak usage; weightstream
with prefetch over the better of transformers' disk offload and mmap
(median of per-round ratios, the target: >= 3x at 25%), its seconds waited
per token over the arm without prefetch (the target: <= 0.5), and whether
every arm generated the same tokens. Failed arms (killed by the cgroup,
say) are listed."""

import glob
import json
import os
import re
import statistics
import sys


def table(out):
    meta = json.load(open(os.path.join(out, "meta.json")))
    runs = {}
    for f in glob.glob(os.path.join(out, "*.json")):
        m = re.match(r"(.+?)-(ws-prefetch|ws-noprefetch|tf-offload|mmap|full)-f([0-9.]+)-b(\d+)-(\d+)\.json$", os.path.basename(f))
        if not m:
            continue
        kind, arm, frac, batch, r = m.group(1), m.group(2), float(m.group(3)), int(m.group(4)), int(m.group(5))
        runs.setdefault((kind, batch), {}).setdefault((arm, frac), {})[r] = json.load(open(f))
    failures = []
    fp = os.path.join(out, "failures.txt")
    if os.path.exists(fp):
        failures = [line.strip() for line in open(fp) if line.strip()]
    md = [
        f"# MoE decode with streamed experts ({meta['date']})",
        "",
        f"A Qwen3-MoE of transformers 5 (synthetic weights): {meta['expert_bytes'] / 1e9:.2f} GB of routed experts, "
        f"{meta['other_bytes'] / 1e9:.2f} GB of other weights, bf16; {meta['tokens']} greedy tokens per prompt, cold cache, "
        f"{meta['rounds']} interleaved rounds; each arm but `full` in a memory cgroup of the other weights + the fraction of the "
        f"experts + {meta['baseline'] / 1e9:.1f} GB. Medians; ratios are medians of per-round ratios.",
        "",
    ]
    summary = {"meta": meta, "cells": {}}
    for (kind, batch), arms in sorted(runs.items()):
        full = arms.get(("full", 1.0), {})
        fracs = sorted({f for a, f in arms if a != "full"})
        for frac in fracs:
            md.append(f"## {kind}, batch {batch}, experts budget {frac:.0%}")
            md.append("")
            md.append("| arm | tokens/s | load s | peak RSS GB | cgroup peak GB | waited s per step | misses per step | rounds |")
            md.append("|---|---|---|---|---|---|---|---|")
            cell = {}
            rows = [(a, arms.get((a, frac), {})) for a in ("ws-prefetch", "ws-noprefetch", "tf-offload", "mmap")] + [("full", full)]
            for arm, rs in rows:
                if not rs:
                    continue
                med = lambda k: statistics.median(v[k] for v in rs.values())  # noqa: E731
                pt = [v["per_token"] for v in rs.values() if "per_token" in v]
                wait = statistics.median(p["wait_seconds"] for p in pt) if pt else None
                miss = statistics.median(p["misses"] for p in pt) if pt else None
                cell[arm] = {"tokens_per_second": med("tokens_per_second"), "load_seconds": med("load_seconds"),
                             "peak_rss_bytes": med("peak_rss_bytes"), "wait_seconds_per_token": wait, "misses_per_token": miss,
                             "rounds": len(rs)}
                cg = statistics.median(v.get("cgroup_max_usage_bytes", 0) for v in rs.values())
                md.append(f"| {arm} | {cell[arm]['tokens_per_second']:.3f} | {cell[arm]['load_seconds']:.1f} | "
                          f"{cell[arm]['peak_rss_bytes'] / 1e9:.2f} | {cg / 1e9:.2f} | {'' if wait is None else f'{wait:.4f}'} | "
                          f"{'' if miss is None else f'{miss:.1f}'} | {len(rs)} |")
            ws = arms.get(("ws-prefetch", frac), {})
            others = [arms.get((a, frac), {}) for a in ("tf-offload", "mmap")]
            ratios = []
            for r, v in ws.items():
                best = max((o[r]["tokens_per_second"] for o in others if r in o), default=None)
                if best:
                    ratios.append(v["tokens_per_second"] / best)
            if ratios:
                cell["ws_over_best_other"] = statistics.median(ratios)
                md.append("")
                md.append(f"weightstream with prefetch over the better of disk offload and mmap: {cell['ws_over_best_other']:.2f}x.")
            nop = arms.get(("ws-noprefetch", frac), {})
            wr = [ws[r]["per_token"]["wait_seconds"] / nop[r]["per_token"]["wait_seconds"] for r in ws if r in nop and nop[r]["per_token"]["wait_seconds"] > 0]
            if wr:
                cell["wait_prefetch_over_noprefetch"] = statistics.median(wr)
                md.append(f"Seconds waited per step (one token of each prompt) with prefetch over without: {cell['wait_prefetch_over_noprefetch']:.2f}.")
            toks = {json.dumps(v["generated"]) for _a, rs in rows for v in rs.values()}
            cell["same_tokens"] = len(toks) <= 1
            md.append(f"Tokens of every arm and round: {'all equal' if cell['same_tokens'] else 'DIFFER'}.")
            md.append("")
            summary["cells"][f"{kind}/b{batch}/f{frac}"] = cell
    if failures:
        md.append("## Failed runs")
        md.append("")
        md += [f"- {f}" for f in failures]
        md.append("")
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print("\n".join(md))


if __name__ == "__main__":
    table(sys.argv[1])

#!/usr/bin/env python3
"""The table of a benches/vllm/bench.sh run: per drive kind and arm, the
median over rounds of the weight-loading GB/s, seconds, CPU s/GB and peak
RSS; each vLLM format's median per-round ratio to vllm-auto's and to
ws-load's (weightstream.load alone) in the same round; whether the vLLM
arms' tokens agreed. Writes OUT/table.md and OUT/summary.json.

    table.py OUT_DIR
"""

import glob
import json
import os
import re
import statistics
import sys


def ahead(arms, arm):
    """(rounds in which ``arm``, a vLLM format, loaded faster than every
    other vLLM format of its kind (TP=1 or TP=2), rounds it ran), or None
    for ws-load. weightstream's variants (with and without the plan or
    its cache) are one format: each is measured against the others."""
    if arm == "ws-load":
        return None
    tp = arm.startswith("tp2-")
    ours = lambda a: a.split("-", 1)[1].startswith("weightstream")  # noqa: E731
    others = [a for a in arms if a != arm and a != "ws-load" and a.startswith("tp2-") == tp and not (ours(a) and ours(arm))]
    rs = arms[arm]
    won = sum(all(rs[r]["gbps"] > arms[o][r]["gbps"] for o in others if r in arms[o]) for r in rs)
    return won, len(rs)


def read_per_rank(rs):
    """Each TP rank's bytes read from storage over the model's, the
    largest and the sum (medians over rounds), where the workers said."""
    per = [v.get("per_rank_read_bytes") for v in rs.values()]
    per = [[b / v["bytes"] for b in p] for p, v in zip(per, rs.values()) if p and all(b is not None for b in p)]
    if not per:
        return None
    return "max %.3f, sum %.3f" % (statistics.median(max(p) for p in per), statistics.median(sum(p) for p in per))


def main():
    out = sys.argv[1]
    meta = json.load(open(os.path.join(out, "meta.json")))
    runs = {}
    for p in glob.glob(os.path.join(out, "*.json")):
        m = re.match(r"(memloop|zram|disk)-(.+)-(\d+)\.json$", os.path.basename(p))
        if not m:
            continue
        kind, arm, r = m.group(1), m.group(2), int(m.group(3))
        runs.setdefault(kind, {}).setdefault(arm, {})[r] = json.load(open(p))
    failures = open(os.path.join(out, "failures.txt")).read().splitlines() if os.path.exists(os.path.join(out, "failures.txt")) else []
    lines = [f"# vLLM load formats ({meta['date']})", ""]
    lines.append(
        f"{meta['rounds']} interleaved rounds, cold cache, a {meta['size'] / 1e9:.2f} GB BF16 Llama-shaped checkpoint in 5 "
        "shards; vLLM's engine in the arm's process; load = the loader's load_weights. Ratios are medians of per-round ratios."
    )
    summary = {}
    for kind in sorted(runs):
        arms = runs[kind]
        lines += ["", f"## {kind}", ""]
        ceiling = os.path.join(out, f"{kind}-ceiling.json")
        if os.path.exists(ceiling):
            c = json.load(open(ceiling))
            lines.append(f"Load ceiling (fio's best over its sweep, and the fault-in of fresh memory): {c['gbps']:.3f} GB/s; fio {c['fio']['gbps']:.3f} GB/s.")
            lines.append("")
        lines.append(
            "| arm | GB/s (median) | load s | CPU s/GB | peak RSS GB | / vllm-auto | / ws-load | rounds ahead of every other format | bytes read per rank / model |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|")
        summary[kind] = {}
        for arm in sorted(arms, key=lambda a: -statistics.median(v["gbps"] for v in arms[a].values())):
            rs = arms[arm]
            med = lambda k: statistics.median(v[k] for v in rs.values())  # noqa: E731

            def ratio(ref):
                if ref not in arms or ref == arm or arm.startswith("tp2-") != ref.startswith("tp2-"):
                    return None
                rr = [rs[r]["gbps"] / arms[ref][r]["gbps"] for r in rs if r in arms[ref]]
                return statistics.median(rr) if rr else None

            row = {
                "rounds": len(rs),
                "tensor_parallel": arm.startswith("tp2-"),
                "gbps": med("gbps"),
                "load_seconds": med("load_seconds"),
                "cpu_seconds_per_gb": med("cpu_seconds_per_gb"),
                "peak_rss_gb": med("peak_rss_bytes") / 1e9,
                "vs_auto": ratio("vllm-auto"),
                "vs_ws_load": ratio("ws-load"),
                "rounds_ahead": ahead(arms, arm),
                "read_per_rank": read_per_rank(rs),
            }
            summary[kind][arm] = row
            f = lambda x: "" if x is None else f"{x:.3f}"  # noqa: E731
            cpu = "" if arm.startswith("tp2-") else f"{row['cpu_seconds_per_gb']:.3f}"
            lines.append(
                f"| {arm} | {row['gbps']:.3f} | {row['load_seconds']:.3f} | {cpu} | "
                f"{row['peak_rss_gb']:.2f} | {f(row['vs_auto'] if not arm.startswith('tp2-') else ratio('tp2-auto'))} | {f(row['vs_ws_load'])} | "
                f"{'' if row['rounds_ahead'] is None else '%d of %d' % row['rounds_ahead']} | {row['read_per_rank'] or ''} |"
            )
        toks = {tuple(v["tokens"]) for a, rs in arms.items() for v in rs.values() if "tokens" in v}
        lines.append("")
        lines.append(f"Greedy tokens of every vLLM run: {'all equal' if len(toks) == 1 else 'DIFFER: ' + str(sorted(toks))}.")
        summary[kind]["_tokens_agree"] = len(toks) == 1
    if failures:
        lines += ["", "## Failures", ""] + [f"- `{f}`" for f in failures]
        for fj in sorted(glob.glob(os.path.join(out, "*.failed.json")))[:4]:
            try:
                lines.append(f"  - {os.path.basename(fj)}: {json.load(open(fj)).get('error', '')[:300]}")
            except Exception:  # noqa: BLE001
                pass
    open(os.path.join(out, "table.md"), "w").write("\n".join(lines) + "\n")
    json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()

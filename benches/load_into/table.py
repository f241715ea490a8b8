#!/usr/bin/env python3
"""The load_into benchmark's table (benches/load_into/bench.sh).

    table.py OUT_DIR                     OUT/table.md and OUT/summary.json
    table.py --line FILE ARM ROUND       one arm's line, as the bench prints it

Per drive kind and arm: the median over rounds of GB/s, seconds, CPU s/GB
and the RSS the load added on top of the allocated model; the ratios of
load_into to the same rounds' weightstream.load and `weightstream load`
(medians of the per-round ratios), and to the load ceiling; whether every
model-filling arm left the same bytes (digest)."""

import glob
import json
import os
import statistics
import sys

ARMS = ["load-into", "ws-load-lsd", "st-load-lsd", "ws-load", "cli-load", "ws-from-pretrained", "tf-patch", "tf-from-pretrained"]
PRETRAINED = ("ws-from-pretrained", "tf-patch", "tf-from-pretrained")
WHAT = {
    "load-into": "`weightstream.torch.load_into(model, dir)`",
    "ws-load-lsd": "`weightstream.load(dir)` + `model.load_state_dict`",
    "st-load-lsd": "`safetensors.torch.load_file` per shard + `model.load_state_dict`",
    "ws-load": "`weightstream.load(dir)` alone (fresh memory, no model)",
    "cli-load": "`weightstream load dir` (`Engine::load_all`, fresh memory)",
    "ws-from-pretrained": "`weightstream.transformers.from_pretrained(dir)`: build + load, to a ready model",
    "tf-patch": "transformers' `from_pretrained` under `weightstream.transformers.patch()`",
    "tf-from-pretrained": "transformers' `AutoModelForCausalLM.from_pretrained(dir)`",
}


def norm(v, arm):
    """(gbps, seconds, cpu s/GB, added RSS bytes or None, digest or None)."""
    if arm == "cli-load":
        return v["gbps"], v["seconds"], v["cpu_seconds_per_gb"], v["peak_rss_bytes"] - v["rss_start_bytes"], None
    return v["gbps"], v["load_seconds"], v["cpu_seconds_per_gb"], v["added_rss_bytes"], v.get("digest")


def line(path, arm, r):
    v = json.load(open(path))
    g, s, c, added, _ = norm(v, arm)
    extra = ""
    if arm in ("load-into", "ws-from-pretrained"):
        rep = v["report"]
        extra = "  in place %.0f%%, staging %.0f MiB, %d copy thread(s)" % (
            100 * rep["in_place_bytes"] / max(rep["bytes"], 1), rep["staging_bytes"] / 2**20, rep["copy_threads"])
    print("  round %s %-12s %6.3f GB/s  %6.3f s  CPU %.3f s/GB  added RSS %.2f GB%s" % (r, arm, g, s, c, added / 1e9, extra))


def table(out):
    meta = json.load(open(os.path.join(out, "meta.json")))
    summary = {"meta": meta, "kinds": {}}
    md = []
    for kind in meta["kinds"]:
        runs = {}
        for f in glob.glob(os.path.join(out, f"{kind}-*-*.json")):
            base = os.path.basename(f)[len(kind) + 1 : -5]
            arm, _, r = base.rpartition("-")
            if arm not in ARMS:
                continue
            runs.setdefault(arm, {})[int(r)] = norm(json.load(open(f)), arm) + (json.load(open(f)),)
        ceiling = None
        cf = os.path.join(out, f"{kind}-ceiling.json")
        if os.path.exists(cf):
            ceiling = json.load(open(cf))
        k = {"arms": {}, "ceiling_gbps": ceiling and ceiling["gbps"], "fio_gbps": ceiling and ceiling["fio"]["gbps"]}
        md.append(f"### {kind}\n")
        if ceiling:
            md.append(f"Load ceiling {ceiling['gbps']:.3f} GB/s (fio's best {ceiling['fio']['gbps']:.3f} GB/s over its sweep; fault-in of fresh memory {ceiling['fault']['gbps']:.3f} GB/s).\n")
        md.append("| arm | what | GB/s | s | CPU s/GB | RSS added (GB) | of ceiling | rounds |")
        md.append("|---|---|---|---|---|---|---|---|")
        bytes_ = None
        for arm in ARMS:
            rs = runs.get(arm)
            if not rs:
                continue
            med = lambda i: statistics.median(x[i] for x in rs.values())  # noqa: E731
            g, s, c, a = med(0), med(1), med(2), med(3)
            bytes_ = bytes_ or next(iter(rs.values()))[5].get("bytes")
            k["arms"][arm] = {"gbps": g, "seconds": s, "cpu_seconds_per_gb": c, "added_rss_bytes": a, "rounds": len(rs)}
            of = f"{g / ceiling['gbps']:.2f}" if ceiling else "-"
            md.append(f"| {arm} | {WHAT[arm]} | {g:.3f} | {s:.3f} | {c:.3f} | {a / 1e9:.3f} | {of} | {len(rs)} |")
        # Per-round ratios of load_into to the fresh-memory loads.
        for ref in ("ws-load", "cli-load", "ws-load-lsd", "st-load-lsd"):
            both = [r for r in runs.get("load-into", {}) if r in runs.get(ref, {})]
            if both:
                ratio = statistics.median(runs["load-into"][r][0] / runs[ref][r][0] for r in both)
                k[f"load_into_over_{ref}"] = ratio
        # Time to a ready model: weightstream's from_pretrained over
        # transformers' own and over it under patch() (per-round ratios).
        for ref in ("tf-from-pretrained", "tf-patch"):
            both = [r for r in runs.get("ws-from-pretrained", {}) if r in runs.get(ref, {})]
            if both:
                k[f"ws_from_pretrained_over_{ref}"] = statistics.median(runs["ws-from-pretrained"][r][0] / runs[ref][r][0] for r in both)
        wfp = runs.get("ws-from-pretrained")
        if wfp:
            added = statistics.median(x[3] for x in wfp.values())
            staging = max(x[5]["report"]["staging_bytes"] for x in wfp.values())
            k["ws_from_pretrained_added_over_model_plus_staging"] = added / (bytes_ + staging) if bytes_ else None
            ratios_fp = ", ".join(f"{ref} {k[f'ws_from_pretrained_over_{ref}']:.2f}x" for ref in ("tf-from-pretrained", "tf-patch") if f"ws_from_pretrained_over_{ref}" in k)
            md.append("")
            md.append(
                "weightstream.transformers.from_pretrained's speed to a ready model over the same rounds' (median of per-round ratios): %s; "
                "its RSS over torch's and transformers' imports %.3f GB, %.3f of the model's %.3f GB plus %.0f MiB of staging."
                % (ratios_fp, added / 1e9, k["ws_from_pretrained_added_over_model_plus_staging"] or 0, (bytes_ or 0) / 1e9, staging / 2**20)
            )
        digests = {arm: {x[4] for x in rs.values()} for arm, rs in runs.items() if arm in ("load-into", "ws-load-lsd", "st-load-lsd") + PRETRAINED}
        all_d = set().union(*digests.values()) if digests else set()
        k["same_bytes"] = len(all_d) == 1
        if wfp:
            md.append("Model bytes after every model-filling arm: %s." % ("identical (one digest)" if k["same_bytes"] else f"DIFFER: {digests}"))
        li = runs.get("load-into")
        if li:
            reps = [x[5]["report"] for x in li.values()]
            k["load_into_report"] = {
                "in_place_fraction": statistics.median(r["in_place_bytes"] / max(r["bytes"], 1) for r in reps),
                "staging_bytes": max(r["staging_bytes"] for r in reps),
                "copy_threads": max(r["copy_threads"] for r in reps),
                "copy_cpu_seconds": statistics.median(r["copy_cpu_seconds"] for r in reps),
            }
            md.append("")
            md.append(
                "load_into: %.0f%% of the bytes read in place (the rest O_DIRECT into %.0f MiB of staging, copied on %d copy thread(s), %.3f CPU s of copies per load); "
                "model bytes after every model-filling arm %s."
                % (100 * k["load_into_report"]["in_place_fraction"], k["load_into_report"]["staging_bytes"] / 2**20, k["load_into_report"]["copy_threads"],
                   k["load_into_report"]["copy_cpu_seconds"], "identical (one digest)" if k["same_bytes"] else f"DIFFER: {digests}")
            )
        ratios = ", ".join(f"{ref} {k[f'load_into_over_{ref}']:.2f}x" for ref in ("ws-load", "cli-load", "ws-load-lsd", "st-load-lsd") if f"load_into_over_{ref}" in k)
        md.append(f"\nload_into's GB/s over the same rounds' (median of per-round ratios): {ratios}.\n")
        summary["kinds"][kind] = k
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print("\n".join(md))


if __name__ == "__main__":
    if sys.argv[1] == "--line":
        line(*sys.argv[2:5])
    else:
        table(sys.argv[1])

#!/usr/bin/env python3
"""The expert-cache record's table from benches/expert-cache.sh's JSON:
per layout and arm, medians over the rounds, and issue 39's targets.

Usage: benches/expert-cache-table.py OUT_DIR > OUT_DIR/table.md
(a record packed by benches/pack-raw.sh: `tar xJf raw.tar.xz` in it first)"""
import glob
import json
import os
import statistics as st
import sys

d = sys.argv[1]
meta = json.load(open(os.path.join(d, "meta.json")))
runs = {}
for f in glob.glob(os.path.join(d, "*-*-*.json")):
    layout, arm, r = os.path.basename(f)[:-5].split("-")
    runs.setdefault((layout, arm), []).append(json.load(open(f)))

ARMS = ["cache", "prefetch", "direct", "pagecache"]
NAMES = {
    "cache": "1. cache, no prefetch",
    "prefetch": "2. cache + next-layer prefetch (%.0f%% right)" % (100 * meta["accuracy"]),
    "direct": "3. no cache: O_DIRECT into slots every use",
    "pagecache": "4. page cache: pread + fadvise(WILLNEED), memory cgroup",
}


def med(vs, key, scale=1.0):
    xs = [v[key] for v in vs if v.get(key) is not None]
    return st.median(xs) * scale if xs else None


def fmt(x, p=1):
    return "-" if x is None else f"{x:.{p}f}"


print(f"Model: {meta['layers']} layers x {meta['experts']} experts x 3 projections (`--expert-bytes {meta['expert_bytes']}`), "
      f"top-{meta['top_k']}; budget {meta['budget_experts']} experts; fake compute {meta['compute_us']} us per layer; "
      f"{meta['rounds']} interleaved rounds, medians; {meta['tokens']} tokens on the fast drive, {meta['tokens_capped']} on the capped ones "
      f"({meta['cap_mbps']} MB/s each).\n")
print("| drives | arm | wait/token median ms | p99 ms | time/token ms | MB read/token | hit rate | CPU s/GB | peak RSS MB | prefetched bytes used |")
print("|---|---|---|---|---|---|---|---|---|---|")
for layout in ["fast", "split", "mirror"]:
    for arm in ARMS:
        vs = runs.get((layout, arm))
        if not vs:
            continue
        rss = med(vs, "peak_rss_bytes", 1e-6)
        if arm == "pagecache" and med(vs, "memcg_peak_bytes") is not None:
            rss_s = f"{fmt(rss, 0)} (+ page cache: cgroup peak {fmt(med(vs, 'memcg_peak_bytes', 1e-6), 0)})"
        else:
            rss_s = fmt(rss, 0)
        share = fmt(med(vs, "prefetch_used_share"), 2) if arm == "prefetch" else ""
        print(f"| {layout} | {NAMES[arm]} | {fmt(med(vs, 'wait_per_token_median_s', 1e3))} | {fmt(med(vs, 'wait_per_token_p99_s', 1e3))} | "
              f"{fmt(med(vs, 'seconds_per_token', 1e3))} | {fmt(med(vs, 'bytes_read_per_token', 1e-6))} | {fmt(med(vs, 'hit_rate'), 3)} | {fmt(med(vs, 'cpu_s_per_gb'), 3)} | {rss_s} | {share} |")

print("\n## Targets\n")
exact = [v.get("hits_equal_lru") for vs in [runs.get((l, "cache"), []) for l in ("fast", "split", "mirror")] for v in vs]
print(f"- Hits equal the LRU simulation of the same gets: {sum(1 for e in exact if e)} of {len(exact)} runs "
      f"({'met' if exact and all(exact) else 'NOT met'}).")
for layout in ["fast", "split", "mirror"]:
    p, pc = runs.get((layout, "prefetch")), runs.get((layout, "pagecache"))
    if p and pc:
        rp = st.median(v["wait_per_token_median_s"] for v in p)
        rc = st.median(v["wait_per_token_median_s"] for v in pc)
        ratio = rp / rc if rc > 0 else float("inf")
        print(f"- {layout}: arm 2's wait per token is {ratio:.2f} of arm 4's (target at most 0.7: {'met' if ratio <= 0.7 else 'NOT met'}).")
for layout in ["split", "mirror"]:
    c = runs.get((layout, "missrate"))
    if c:
        rates = [v["cache_bytes_read"] / v["miss_read_seconds"] / 1e6 for v in c if v.get("miss_read_seconds")]
        if rates:
            r = st.median(rates)
            want = 2 * meta["cap_mbps"]
            note = (" (a layer's experts lie in one shard, on one drive: the other idles and banks credit under its cap, "
                    "so this is the caps' artefact as much as the drives' sum)") if layout == "split" else ""
            print(f"- {layout}: misses read at {r:.0f} MB/s while callers waited (the cache arm with no compute between "
                  f"the layers), {r / want:.2f} of the two drives' caps ({want} MB/s; target 0.9: "
                  f"{'met' if r / want >= 0.9 else 'NOT met'}){note}.")

#!/usr/bin/env python3
"""benches/peers.sh's table, summary and charts.

Usage: peers-table.py OUT_DIR [WEIGHTSTREAM_BINARY]

Reads OUT_DIR/meta.json (kinds, rounds, arms, the weightstream binary) when
there is one, else takes the kinds, arms and rounds from the file names;
then OUT_DIR/KIND-ARM-ROUND.json (every arm's runs), OUT_DIR/KIND-ceiling-
{0,1}.json (`weightstream load-ceiling --json`, before and after the
rounds) and OUT_DIR/failures.txt.

Per kind and arm, over the runs that succeeded: the median GB/s; the median
over rounds of its ratio to that round's fio run (the sweep's best
configuration, OUT_DIR/KIND-roundceiling-ROUND.json) and to that round's
load ceiling (that fio run, that round's fault-in, their busy CPU over the
CPUs); its ratio to the sweeps' fio
best and load ceiling (the better of the two load-ceiling runs: a best of
many noisy samples, biased up); min-max GB/s, the
median CPU s/GB (the process's, getrusage), the median machine-wide busy
CPU s/GB (arm.py's arms only), the median peak RSS over the process's RSS
when its clock started, per model byte. Writes OUT_DIR/table.md,
OUT_DIR/summary.json and OUT_DIR/KIND-gbps.svg (median GB/s per arm, the
reference line at the load ceiling) through `weightstream plot`.
"""
import glob
import json
import os
import re
import statistics
import subprocess
import sys

ARMS = ["weightstream", "weightstream-reused", "weightstream-faulted", "weightstream-before", "ws-py-load", "ws-py-safeopen", "fresh-read", "safetensors", "safetensors09", "runai", "fastsafetensors"]
WHAT = {
    "weightstream": "weightstream load",
    "weightstream-reused": "weightstream load --memory reused (judged against fio's best)",
    "weightstream-faulted": "weightstream load --memory faulted (judged against fio's best)",
    "weightstream-before": "weightstream load, the build before (WS_BEFORE_BIN)",
    "ws-py-load": "weightstream.load (Python)",
    "ws-py-safeopen": "weightstream.safe_open + get_tensor (Python)",
    "fresh-read": "fresh-read.c: the files' bytes O_DIRECT into fresh memory, no tensors (not a loader)",
    "safetensors": "safetensors.torch.load_file",
    "safetensors09": "safetensors.torch.load_file, safetensors 0.9",
    "runai": "runai SafetensorsStreamer",
    "fastsafetensors": "fastsafetensors nogds",
}

# Arms that hand back no fresh memory: judged against fio, not the load
# ceiling (whose fault-in part they do not pay).
NOT_FRESH = ("weightstream-reused", "weightstream-faulted")


def load(path):
    with open(path) as f:
        return json.load(f)


def over_baseline(v):
    """Peak RSS over the RSS when the clock started: arm.py reports it;
    weightstream load reports the two it is made of."""
    if "peak_rss_over_baseline_bytes" in v:
        return v["peak_rss_over_baseline_bytes"]
    return v["peak_rss_bytes"] - v.get("rss_start_bytes", 0)


PEERS = ("safetensors", "safetensors09", "runai", "fastsafetensors")


def round_pairs(by_round, round_fio):
    """Per-round ratios the issues judge, each over the rounds where both
    sides ran: the Python load against the command (as measured, and less
    arm.py's touch, which the command does not pay), either load against
    the fastest peer of its round and each peer alone, the command
    against the bare fresh_read.c, safe_open + get_tensor against
    safetensors, and the loads into memory that is no longer fresh against
    the round's fio."""
    def secs(arm, r, less_touch=False):
        v = by_round.get(arm, {}).get(r)
        if v is None:
            return None
        return v["seconds"] - (v.get("touch_seconds") or 0.0 if less_touch else 0.0)

    def fastest_peer(r):
        ss = [secs(a, r) for a in PEERS if secs(a, r) is not None]
        return min(ss) if ss else None

    rounds = sorted({r for d in by_round.values() for r in d})
    wanted = [
        ("weightstream.load (Python) / weightstream load", lambda r: (secs("weightstream", r), secs("ws-py-load", r))),
        ("weightstream.load (Python) less arm.py's touch / weightstream load",
         lambda r: (secs("weightstream", r), secs("ws-py-load", r, True)
                    if by_round.get("ws-py-load", {}).get(r, {}).get("touch_seconds") is not None else None)),
        # The fastest of three noisy draws beats one draw of a loader just
        # as fast more often than not: so each peer alone too, paired.
        ("weightstream load / fastest peer", lambda r: (fastest_peer(r), secs("weightstream", r))),
        *((f"weightstream load / {peer}", (lambda peer: lambda r: (secs(peer, r), secs("weightstream", r)))(peer))
          for peer in PEERS),
        # The bare O_DIRECT read into fresh memory (not a loader): what the
        # load's own work costs beyond the read and the fault-in.
        ("weightstream load / fresh-read.c", lambda r: (secs("fresh-read", r), secs("weightstream", r))),
        ("weightstream.load (Python) / fastest peer", lambda r: (fastest_peer(r), secs("ws-py-load", r))),
        ("safe_open + get_tensor / safetensors", lambda r: (secs("safetensors", r), secs("ws-py-safeopen", r))),
    ]
    out = {}
    for label, f in wanted:
        # Speed ratio: the other side's time over this side's.
        xs = [a / b for a, b in (f(r) for r in rounds) if a is not None and b]
        if xs:
            out[label] = {"median": statistics.median(xs), "min": min(xs), "max": max(xs),
                          "above_one": sum(x > 1 for x in xs), "rounds": len(xs)}
    for arm in NOT_FRESH:
        xs = [v["gbps"] / round_fio[r] for r, v in by_round.get(arm, {}).items() if r in round_fio]
        if xs:
            out[f"{arm} / fio, same round"] = {"median": statistics.median(xs), "min": min(xs), "max": max(xs),
                                               "above_one": sum(x > 1 for x in xs), "rounds": len(xs)}
    return out


def judge(per, pairs):
    """Issue 38's targets for one drive kind, from the arms' medians and
    the per-round ratios: the command's load at 0.95 or more of the bare
    read into fresh memory, ahead of every peer, at most 0.3 CPU s/GB and
    1.05x the model's RSS; the Python load's CPU per GB at most half the
    best peer's and at most the bare read's plus 0.05 s/GB."""
    out = []

    def add(target, measured, met):
        # met None: a figure kept for the record, no target to meet.
        out.append({"target": target, "measured": measured, "met": None if met is None else bool(met)})

    ws, py, bare = per.get("weightstream", {}), per.get("ws-py-load", {}), per.get("fresh-read", {})
    if ws.get("runs"):
        x = ws.get("x_round_bare_read")
        if x is not None:
            add("weightstream load >= 0.95 x the bare read", f"{x:.3f}", x >= 0.95)
        for peer in PEERS:
            v = pairs.get(f"weightstream load / {peer}")
            if v:
                add(f"weightstream load ahead of {peer}", f"{v['median']:.2f}x ({v['above_one']}/{v['rounds']} rounds)", v["median"] > 1.0)
        add("weightstream load CPU <= 0.3 s/GB", f"{ws['cpu_seconds_per_gb']:.3f}", ws["cpu_seconds_per_gb"] <= 0.3)
        add("weightstream load peak RSS <= 1.05 x model", f"{ws['peak_rss_over_baseline_per_model']:.3f}", ws["peak_rss_over_baseline_per_model"] <= 1.05)
    if py.get("runs"):
        x = py.get("x_round_bare_read")
        if x is not None:
            add("weightstream.load (Python) against the bare read (for the record)", f"{x:.3f}", None)
        peer_cpu = [per[p]["cpu_seconds_per_gb"] for p in PEERS if per.get(p, {}).get("runs")]
        if peer_cpu:
            best = min(peer_cpu)
            add("weightstream.load (Python) CPU <= 0.5 x the best peer's", f"{py['cpu_seconds_per_gb']:.3f} s/GB against {best:.3f} ({py['cpu_seconds_per_gb'] / best:.2f}x)",
                py["cpu_seconds_per_gb"] <= 0.5 * best)
        if bare.get("runs"):
            lim = bare["cpu_seconds_per_gb"] + 0.05
            add("weightstream.load (Python) CPU <= the bare read's + 0.05 s/GB", f"{py['cpu_seconds_per_gb']:.3f} s/GB against {lim:.3f}",
                py["cpu_seconds_per_gb"] <= lim)
    return out


def fmt(x, spec=".3f"):
    return "n/a" if x is None else format(x, spec)


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    out = sys.argv[1]
    meta = load(f"{out}/meta.json") if os.path.exists(f"{out}/meta.json") else {}
    cpus = int(meta.get("cpus") or os.cpu_count() or 1)
    ws = sys.argv[2] if len(sys.argv) > 2 else meta.get("weightstream")
    runs_re = re.compile(r"^([a-z0-9]+)-([a-z0-9-]+)-([1-9][0-9]*)\.json$")
    found = [m.groups() for m in (runs_re.match(os.path.basename(p)) for p in glob.glob(f"{out}/*.json")) if m]
    kinds = meta.get("kinds") or sorted({k for k, a, _ in found if a != "ceiling"})
    arms = meta.get("arms") or [a for a in ARMS if any(x == a for _, x, _ in found)]
    rounds = meta.get("rounds") or max((int(r) for _, a, r in found if a != "ceiling"), default=0)
    failures = []
    if os.path.exists(f"{out}/failures.txt"):
        failures = [l.split() for l in open(f"{out}/failures.txt") if l.strip()]

    summary = {"meta": meta, "kinds": {}}
    lines = [
        "| drive | arm | GB/s (median) | min-max GB/s | runs ok | x bare read, same round (min-max) | x fio, same round | x load ceiling, same round (min-max) | x fio best of sweeps | x load ceiling of sweeps | CPU s/GB | machine busy CPU s/GB | peak RSS over start / model |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    target_lines = []
    pair_lines = [
        "| drive | per-round ratio | median | min-max | rounds above 1 |",
        "|---|---|---|---|---|",
    ]
    for kind in kinds:
        ceilings = [load(p) for p in (f"{out}/{kind}-ceiling-{i}.json" for i in (0, 1)) if os.path.exists(p)]
        best = max(ceilings, key=lambda v: v["gbps"]) if ceilings else None
        fio = max((v["fio"] for v in ceilings), key=lambda f: f["gbps"]) if ceilings else None
        ceiling_gbps = best["gbps"] if best else None
        fio_gbps = fio["gbps"] if fio else None
        # Each round's own ceiling: its fio run (the sweep's best
        # configuration) and fault-in, and their busy CPU over the CPUs.
        round_ceiling, round_fio = {}, {}
        for r in range(1, rounds + 1):
            p = f"{out}/{kind}-roundceiling-{r}.json"
            if not os.path.exists(p):
                continue
            v = load(p)
            round_ceiling[r] = v["gbps"]
            round_fio[r] = v["fio"]["gbps"]
        per = {}
        by_round = {}  # arm -> {round: record}
        for arm in arms:
            rs, rs_round = [], []
            for r in range(1, rounds + 1):
                p = f"{out}/{kind}-{arm}-{r}.json"
                if os.path.exists(p):
                    rs.append(load(p))
                    rs_round.append(r)
            by_round[arm] = dict(zip(rs_round, rs))
            failed = sum(1 for f in failures if f[:2] == [kind, arm] and len(f) > 2 and f[2].isdigit())
            if not rs:
                per[arm] = {"runs": 0, "failed": failed}
                lines.append(f"| {kind} | {WHAT.get(arm, arm)} | failed | | 0/{rounds} | | | | | | | | |")
                continue
            med = lambda f: statistics.median(f(v) for v in rs)
            gb = [v["gbps"] for v in rs]
            busy = [v["busy_cpu_seconds"] / (v["bytes"] / 1e9) for v in rs if v.get("busy_cpu_seconds") is not None]
            # The host's steal over each run's timed region, as a share of
            # the machine's CPU time then (records before steal was kept
            # have none).
            steal = [v["steal_seconds"] / (v["seconds"] * cpus) for v in rs
                     if v.get("steal_seconds") is not None and v["seconds"] > 0]
            p = {
                "runs": len(rs),
                "failed": failed,
                "bytes": rs[0]["bytes"],
                "tensors": rs[0].get("tensors"),
                "gbps": med(lambda v: v["gbps"]),
                "gbps_min": min(gb),
                "gbps_max": max(gb),
                "runs_gbps": gb,
                "seconds": med(lambda v: v["seconds"]),
                "cpu_seconds_per_gb": med(lambda v: v["cpu_seconds_per_gb"]),
                "busy_cpu_seconds_per_gb": statistics.median(busy) if busy else None,
                "steal_share": statistics.median(steal) if steal else None,
                "steal_share_max": max(steal) if steal else None,
                "peak_rss_over_baseline_per_model": med(lambda v: over_baseline(v) / v["bytes"]),
                "peak_rss_bytes": med(lambda v: v["peak_rss_bytes"]),
                "x_fio_best": None,
                "x_load_ceiling": None,
            }
            if fio_gbps:
                p["x_fio_best"] = p["gbps"] / fio_gbps
            if ceiling_gbps:
                p["x_load_ceiling"] = p["gbps"] / ceiling_gbps
            pairs = [(v["gbps"], r) for v, r in zip(rs, rs_round) if r in round_ceiling]
            if pairs:
                p["x_round_fio"] = statistics.median(g / round_fio[r] for g, r in pairs)
                p["x_round_ceiling"] = statistics.median(g / round_ceiling[r] for g, r in pairs)
                p["x_round_ceiling_min_max"] = [min(g / round_ceiling[r] for g, r in pairs), max(g / round_ceiling[r] for g, r in pairs)]
            # The bare O_DIRECT read into fresh memory of the same round
            # (benches/peers/fresh_read.c, the sweep's best configuration).
            fresh = {}
            p_fresh = f"{out}/{kind}-fresh-read-%d.json"
            for r in range(1, rounds + 1):
                if os.path.exists(p_fresh % r):
                    fresh[r] = load(p_fresh % r)["gbps"]
            xs = [v["gbps"] / fresh[r] for v, r in zip(rs, rs_round) if r in fresh]
            if xs and arm != "fresh-read":
                p["x_round_bare_read"] = statistics.median(xs)
                p["x_round_bare_read_min_max"] = [min(xs), max(xs)]
            cfg = next((v.get("config") for v in rs if v.get("config")), None)
            if cfg:
                p["config"] = cfg
            ver = next((v.get("versions") for v in rs if v.get("versions")), None)
            if ver:
                p["versions"] = ver
            per[arm] = p
            if p.get("x_round_ceiling") and arm not in NOT_FRESH and p["x_round_ceiling"] > 1.0:
                notes.append(
                    f"{kind}: {arm} is above the load ceiling of its own rounds (median ratio {p['x_round_ceiling']:.3f}): "
                    "the ceiling is wrong, not the arm that fast"
                )
            if ceiling_gbps and arm not in NOT_FRESH and p["gbps"] > ceiling_gbps:
                notes.append(
                    f"{kind}: {arm} ({p['gbps']:.3f} GB/s) beats the load ceiling ({ceiling_gbps:.3f}): the ceiling is wrong, "
                    "not the arm that fast; see the ceiling's parts in summary.json"
                )
            if fio_gbps and p["gbps"] > fio_gbps:
                notes.append(f"{kind}: {arm} ({p['gbps']:.3f} GB/s) beats fio's best ({fio_gbps:.3f}): fio's sweep missed the drive's best")
            lines.append(
                f"| {kind} | {WHAT.get(arm, arm)} | {p['gbps']:.3f} | {p['gbps_min']:.2f}-{p['gbps_max']:.2f} | "
                f"{p['runs']}/{rounds} | {fmt(p.get('x_round_bare_read'), '.2f')} ({'-'.join(fmt(x, '.2f') for x in p.get('x_round_bare_read_min_max', [None, None]))}) | {fmt(p.get('x_round_fio'), '.2f')} | "
                f"{fmt(p.get('x_round_ceiling'), '.2f')} ({'-'.join(fmt(x, '.2f') for x in p.get('x_round_ceiling_min_max', [None, None]))}) | "
                f"{fmt(p['x_fio_best'], '.2f')} | {fmt(p['x_load_ceiling'], '.2f')} | "
                f"{p['cpu_seconds_per_gb']:.3f} | {fmt(p['busy_cpu_seconds_per_gb'])} | {p['peak_rss_over_baseline_per_model']:.3f} |"
            )
        if fio:
            label = fio.get("best_label", "")
            lines.append(f"| {kind} | fio best (load-ceiling's sweep, before and after{': ' + label if label else ''}) | {fio_gbps:.3f} | | | | | | 1.00 | {fmt(fio_gbps / ceiling_gbps if ceiling_gbps else None, '.2f')} | | {fmt(fio.get('busy_cpu_seconds') / (best['bytes'] / 1e9) if fio.get('busy_cpu_seconds') is not None else None)} | |")
        if round_ceiling:
            rc, rf = list(round_ceiling.values()), list(round_fio.values())
            lines.append(f"| {kind} | fio, that configuration, each round | {statistics.median(rf):.3f} | {min(rf):.2f}-{max(rf):.2f} | {len(rf)}/{rounds} | | 1.00 | | | | | | |")
            lines.append(f"| {kind} | load ceiling, each round | {statistics.median(rc):.3f} | {min(rc):.2f}-{max(rc):.2f} | {len(rc)}/{rounds} | | | 1.00 | | | | | |")
        if best:
            lines.append(f"| {kind} | load ceiling of the sweeps ({best['bound']} bound; better of before and after) | {ceiling_gbps:.3f} | {min(v['gbps'] for v in ceilings):.2f}-{max(v['gbps'] for v in ceilings):.2f} | {len(ceilings)}/2 | | | | {fmt(ceiling_gbps / fio_gbps if fio_gbps else None, '.2f')} | 1.00 | | | |")
        else:
            notes.append(f"{kind}: no load-ceiling run succeeded: no ratios to fio or to the ceiling.")
        stolen = {a: p for a, p in per.items() if p.get("steal_share") is not None}
        if stolen:
            worst = max(stolen.items(), key=lambda kv: kv[1]["steal_share_max"])
            notes.append(
                f"{kind}: the host's steal over the arms' timed regions: a median "
                f"{statistics.median(p['steal_share'] for p in stolen.values()):.1%} of the machine's CPU time, "
                f"at most {worst[1]['steal_share_max']:.1%} ({worst[0]}); a figure taken under steal was paced "
                "by the host's other tenants too"
            )
        pairs = round_pairs(by_round, round_fio)
        for label, v in pairs.items():
            pair_lines.append(
                f"| {kind} | {label} | {v['median']:.3f} | {v['min']:.2f}-{v['max']:.2f} | {v['above_one']}/{v['rounds']} |"
            )
        targets = judge(per, pairs)
        for t in targets:
            verdict = "no target" if t["met"] is None else "met" if t["met"] else "**not met**"
            target_lines.append(f"| {kind} | {t['target']} | {t['measured']} | {verdict} |")
        summary["kinds"][kind] = {
            "targets": targets,
            "round_pairs": pairs,
            "round_load_ceiling_gbps": round_ceiling,
            "round_fio_gbps": round_fio,
            "load_ceiling_gbps": ceiling_gbps,
            "load_ceiling_bound": best["bound"] if best else None,
            "fio_best_gbps": fio_gbps,
            "fio_best_label": fio.get("best_label") if fio else None,
            "fault_gbps": max(v["fault"]["gbps"] for v in ceilings) if ceilings else None,
            "ceilings": ceilings,
            "arms": per,
        }
        bars = [[a, per[a]["gbps"]] for a in arms if per[a].get("runs")]
        if ws and bars:
            spec = {
                "title": f"Whole model into process memory on {kind}, cold cache, median of {rounds}: GB/s (line: the load ceiling)",
                "unit": "GB/s",
                "bars": bars,
                "reference": ceiling_gbps if ceiling_gbps else 0.0,
            }
            sp = f"{out}/{kind}-gbps.plot.json"
            with open(sp, "w") as f:
                json.dump(spec, f)
            r = subprocess.run([ws, "plot", sp, f"{out}/{kind}-gbps.svg"], capture_output=True, text=True)
            if r.returncode != 0:
                notes.append(f"{kind}: the chart failed: {r.stderr.strip()}")
    for f in failures:
        notes.append("failed: " + " ".join(f))
    text = "\n".join(lines) + "\n"
    if target_lines:
        text += "\nTargets (issue 38; ratios are medians of per-round ratios):\n\n"
        text += "| drive | target | measured | |\n|---|---|---|---|\n" + "\n".join(target_lines) + "\n"
    if len(pair_lines) > 2:
        text += "\nRatios of two arms in the same round (medians over the rounds where both ran):\n\n"
        text += "\n".join(pair_lines) + "\n"
    if notes:
        text += "\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    with open(f"{out}/summary.json", "w") as f:
        json.dump(summary, f, indent=1)
    with open(f"{out}/table.md", "w") as f:
        f.write(text)
    print(text, end="")


if __name__ == "__main__":
    main()

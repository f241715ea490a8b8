#!/usr/bin/env python3
"""The scaling model from benches/scaling.sh's measurements.

    scaling-model.py OUT_DIR       -> OUT/model.md, OUT/model.json

Per GB loaded, the CPU seconds of each part, measured on this machine:
  c_engine  the engine's own work (ring thread, submission, completion,
            the caller): `weightstream load --memory faulted`'s process CPU
            per GB (memory already faulted in; the drive's copy is a kernel
            thread's, not the process's)
  c_clear   the kernel's clear of fresh memory at first touch: 1 / the clear
            rate of one thread on 2 MiB pages (rates.c)
  c_copy    one copy through staging (load_into of memory out of phase):
            1 / the memcpy rate of one thread (rates.c)
  c_dev     the simulated drive's own copy (the memloop loop worker): the
            machine's busy CPU per GB over fio's best read, less nothing
            (fio's own thread is in it: an upper bound). An NVMe drive's
            DMA costs no CPU: c_dev is 0 in the projection.

The model: with P CPUs, a load's GB/s is the least of the drives' rate and
P / (the sum of the per-GB costs it pays); a load into fresh memory pays
c_clear, one into faulted memory does not. Checked against the loads
measured on 1 and 4 memloop drives. Then projected to 8 NVMe drives at
14 GB/s (112 GB/s): the cores each part needs, the memory traffic, and
which limit of the design is met first (one ring thread per drive; the
fault-ahead helpers, at most two per drive; memory bandwidth)."""

import glob
import json
import os
import statistics
import sys


def med(out, key, field):
    vs = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(out, f"{key}-[0-9]*.json")))]
    return statistics.median(v[field] for v in vs) if vs else None


def busy_per_gb(out, key):
    xs = []
    for p in sorted(glob.glob(os.path.join(out, f"{key}-[0-9]*.json"))):
        v = json.load(open(p))
        b = float(open(p[: -len(".json")] + ".busy").read())
        xs.append(b / (v["bytes"] / 1e9))
    return statistics.median(xs) if xs else None


def main():
    out = sys.argv[1]
    meta = json.load(open(os.path.join(out, "meta.json")))
    P = meta["cpus"]
    rates = {(r["what"], r["pages"], r["threads"]): r for r in json.load(open(os.path.join(out, "rates.json")))["rates"]}
    clear1 = rates[("clear", "2M", 1)]["gbps"]
    clear4k1 = rates[("clear", "4K", 1)]["gbps"]
    copy1 = rates[("copy", "2M", 1)]["gbps"]
    clearP = rates.get(("clear", "2M", P), {}).get("gbps")
    copyP = rates.get(("copy", "2M", P), {}).get("gbps")
    ceiling = json.load(open(os.path.join(out, "ceiling.json")))
    fio = ceiling["fio"]["gbps"]
    fio_busy = ceiling["fio"]["busy_cpu_seconds"] / (ceiling["bytes"] / 1e9)
    c_engine = med(out, "1-faulted", "cpu_seconds_per_gb")
    c_clear = 1 / clear1
    c_copy = 1 / copy1
    c_dev = fio_busy
    m = {"cpus": P, "per_gb": {"c_engine": c_engine, "c_clear_2M": c_clear, "c_clear_4K": 1 / clear4k1, "c_copy": c_copy, "c_dev_memloop": c_dev},
         "rates": {"clear_2M_1": clear1, "clear_4K_1": clear4k1, "copy_1": copy1, f"clear_2M_{P}": clearP, f"copy_{P}": copyP, "fio_1_drive": fio},
         "check": [], "projection": {}}
    lines = [f"# The scaling model: measured parts ({P} CPUs, {meta.get('cpu_model')})", "",
             "| part | per GB | measured as |", "|---|---|---|",
             f"| c_engine | {c_engine:.3f} CPU s | `load --memory faulted`, process CPU per GB, median of {meta['runs']} on one memloop drive |",
             f"| c_clear | {c_clear:.3f} CPU s (4 KiB pages: {1 / clear4k1:.3f}) | first touch of fresh memory, one thread: {clear1:.2f} GB/s on 2 MiB pages, {clear4k1:.2f} on 4 KiB |",
             f"| c_copy | {c_copy:.3f} CPU s | memcpy between written buffers, one thread: {copy1:.2f} GB/s ({P} threads: {copyP:.2f} GB/s in all) |",
             f"| c_dev (memloop) | {c_dev:.3f} CPU s | the machine's busy CPU per GB over fio's best read ({fio:.2f} GB/s): the loop worker's copy, and fio |",
             "", "## The check: predicted against measured", "",
             "| drives | memory | predicted GB/s | bound | measured GB/s (median) | measured / predicted | the load's process CPU s/GB measured | predicted (c_engine, + c_clear when fresh) |",
             "|---|---|---|---|---|---|---|---|"]
    for n in (1, 4):
        for memory in ("faulted", "fresh"):
            key = f"{n}-{memory}"
            got = med(out, key, "gbps")
            if got is None:
                continue
            cost = c_engine + c_dev + (c_clear if memory == "fresh" else 0.0)
            cpu_rate = P / cost
            drive_rate = n * fio
            pred = min(cpu_rate, drive_rate)
            bound = "CPU" if cpu_rate < drive_rate else "drives"
            # The machine's busy CPU (KEY-R.busy) spans the whole process,
            # the arena's faulting and the start included: kept in the
            # JSON, not compared. The load's own process CPU is.
            busy = busy_per_gb(out, key)
            own = med(out, key, "cpu_seconds_per_gb")
            own_pred = c_engine + (c_clear if memory == "fresh" else 0.0)
            m["check"].append({"drives": n, "memory": memory, "predicted_gbps": pred, "bound": bound, "measured_gbps": got,
                               "ratio": got / pred, "process_cpu_per_gb": own, "predicted_process_cpu_per_gb": own_pred,
                               "whole_run_busy_per_gb": busy, "predicted_machine_cpu_per_gb": cost})
            lines.append(f"| {n} | {memory} | {pred:.2f} | {bound} | {got:.2f} | {got / pred:.2f} | {own:.3f} | {own_pred:.3f} |")
    # 8 NVMe drives at 14 GB/s each: no CPU for the drive's own copy (DMA).
    R, D = 112.0, 8
    proj = {
        "faulted": R * c_engine,
        "fresh": R * (c_engine + c_clear),
        "fresh_4K_pages": R * (c_engine + 1 / clear4k1),
        "staged_into_faulted": R * (c_engine + c_copy),
    }
    per_drive_ring = 14.0 * c_engine
    helpers_rate = 2 * clear1
    traffic = {"faulted": R, "fresh": 2 * R, "staged_into_faulted": 3 * R}
    m["projection"] = {"gbps": R, "drives": D, "cores": proj, "ring_thread_busy_share": per_drive_ring,
                       "fault_ahead_helpers_gbps_per_drive": helpers_rate, "memory_traffic_gbps": traffic}
    lines += ["", f"## Projection: {D} NVMe drives at 14 GB/s ({R:.0f} GB/s), from the parts above", "",
              "| load | cores busy | memory traffic (GB/s) |", "|---|---|---|",
              f"| into memory already faulted in (`--memory reused/faulted`, an engine's arena) | {proj['faulted']:.1f} | {traffic['faulted']:.0f} (the drives' DMA writes) |",
              f"| into fresh memory, 2 MiB pages (`load`) | {proj['fresh']:.1f} | {traffic['fresh']:.0f} (DMA + the kernel's clear) |",
              f"| into fresh memory, 4 KiB pages | {proj['fresh_4K_pages']:.1f} | {traffic['fresh']:.0f} |",
              f"| through staging into faulted memory (`load_into` out of phase) | {proj['staged_into_faulted']:.1f} | {traffic['staged_into_faulted']:.0f} (DMA + copy read + copy write) |",
              "",
              f"- One ring thread per drive: {per_drive_ring:.2f} of a core busy at 14 GB/s ({1 / c_engine:.0f} GB/s per core at c_engine).",
              f"- The fault-ahead helpers, at most two per drive: {helpers_rate:.1f} GB/s of clearing per drive on 2 MiB pages, against the 14 GB/s each drive delivers.",
              ]
    open(os.path.join(out, "model.md"), "w").write("\n".join(lines) + "\n")
    json.dump(m, open(os.path.join(out, "model.json"), "w"), indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# Where a whole-model load's time goes, on one drive, against its load
# ceiling: what issue "loads at the load ceiling" asks to be written down
# before and after any change to the load path.
#
#   benches/load-profile.sh MODEL_DIR OUT_DIR [LOAD ARGS...]   (root)
#   WS_BIN: the build whose load is profiled (default target/release/weightstream)
#
# For `weightstream load MODEL_DIR LOAD_ARGS`, each from a cold cache:
#   1. the load ceiling of the model (weightstream load-ceiling --json);
#   2. three plain loads (--json: seconds, CPU, the report);
#   3. perf record -a (software clock, every CPU: the kernel threads that
#      work for the load, as a memloop drive's loop workers, are on the
#      other side of the drive) -> OUT/perf-comm.txt (share per thread
#      name) and OUT/perf-sym.txt (per thread and symbol);
#   4. /proc/vmstat and /proc/stat around one load: page faults, THP faults
#      and fallbacks, compaction stalls, machine busy CPU -> OUT/vmstat.txt;
#   5. /usr/bin/time -v: minor faults, voluntary and involuntary context
#      switches of the process -> OUT/time.txt;
#   6. strace -f -c: syscalls per GB (a separate, slower run: only the
#      counts are used) -> OUT/strace.txt;
#   7. /proc/PID/task/*/sched and comm of every thread, sampled every
#      20 ms while the load runs, the last sample with the most threads kept
#      -> OUT/sched.txt; io-wq workers (iou-wrk-*) included.
# Then OUT/summary.txt: the numbers side by side.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "load-profile: SKIP: needs root (drop_caches, perf -a)"; exit 0; }
dir=${1:?model dir}
out=${2:?out dir}
shift 2
ws=${WS_BIN:-target/release/weightstream}
# The ceiling is the machine's, not the build's: the current build measures
# it even when WS_BIN is an older one (which may have no load-ceiling).
ceiling_ws=${CEILING_BIN:-target/release/weightstream}
mkdir -p "$out"
# shellcheck source=benches/machine.sh
. benches/machine.sh
machine_save
trap machine_restore EXIT
machine_quiet

cold
"$ceiling_ws" load-ceiling "$dir" --json > "$out/ceiling.json"
for i in 1 2 3; do
    cold
    "$ws" load "$dir" "$@" --json > "$out/load-$i.json" 2>/dev/null
done

cold
perf record -q -a -g -F 4000 -o "$out/perf.data" -- "$ws" load "$dir" "$@" --json > "$out/load-perf.json" 2>/dev/null
perf report -i "$out/perf.data" --no-children --sort comm --stdio 2>/dev/null | grep -E '^\s+[0-9]' > "$out/perf-comm.txt" || true
perf report -i "$out/perf.data" --no-children --sort comm,sym --stdio -g none 2>/dev/null | grep -E '^\s+[0-9]' | head -n 60 > "$out/perf-sym.txt" || true
rm -f "$out/perf.data"

cold
grep -E '^(pgfault|thp_fault_alloc|thp_fault_fallback|compact_stall|compact_fail|compact_success|pgalloc_normal|thp_split_pmd) ' /proc/vmstat > "$out/vmstat-0"
head -n 1 /proc/stat > "$out/stat-0"
"$ws" load "$dir" "$@" --json > "$out/load-vmstat.json" 2>/dev/null
grep -E '^(pgfault|thp_fault_alloc|thp_fault_fallback|compact_stall|compact_fail|compact_success|pgalloc_normal|thp_split_pmd) ' /proc/vmstat > "$out/vmstat-1"
head -n 1 /proc/stat > "$out/stat-1"
python3 - "$out" <<'EOF'
import sys
out = sys.argv[1]
def kv(p):
    return {l.split()[0]: int(l.split()[1]) for l in open(p)}
a, b = kv(f"{out}/vmstat-0"), kv(f"{out}/vmstat-1")
s0 = list(map(int, open(f"{out}/stat-0").read().split()[1:]))
s1 = list(map(int, open(f"{out}/stat-1").read().split()[1:]))
busy = lambda s: s[0] + s[1] + s[2] + s[5] + s[6] + s[7]
with open(f"{out}/vmstat.txt", "w") as f:
    for k in a:
        f.write(f"{k} {b[k] - a[k]}\n")
    f.write(f"machine_busy_ticks {busy(s1) - busy(s0)}\n")
EOF
rm -f "$out"/vmstat-? "$out"/stat-?

cold
/usr/bin/time -v "$ws" load "$dir" "$@" --json > "$out/load-time.json" 2> "$out/time.txt" || true

cold
strace -f -c -o "$out/strace.txt" "$ws" load "$dir" "$@" --json > "$out/load-strace.json" 2>/dev/null || true

cold
"$ws" load "$dir" "$@" --json > "$out/load-sched.json" 2>/dev/null &
pid=$!
: > "$out/sched.txt"
while kill -0 "$pid" 2>/dev/null; do
    snap=""
    for t in /proc/"$pid"/task/*; do
        c=$(cat "$t/comm" 2>/dev/null) || continue
        s=$(grep -E '^(se.sum_exec_runtime|nr_switches|nr_voluntary_switches|nr_involuntary_switches|nr_migrations)' "$t/sched" 2>/dev/null | awk '{printf "%s=%s ", $1, $3}') || continue
        snap+="$c $s"$'\n'
    done
    # The snapshot with the most threads (the I/O threads end before the
    # process does).
    if [ -n "$snap" ] && [ "$(printf '%s' "$snap" | wc -l)" -ge "$(wc -l < "$out/sched.txt")" ]; then
        printf '%s' "$snap" > "$out/sched.txt"
    fi
    sleep 0.02
done
wait "$pid" || true

python3 - "$out" <<'EOF'
import json, re, statistics, sys
out = sys.argv[1]
c = json.load(open(f"{out}/ceiling.json"))
loads = [json.load(open(f"{out}/load-{i}.json")) for i in (1, 2, 3)]
gb = loads[0]["bytes"] / 1e9
med = statistics.median(v["seconds"] for v in loads)
lines = [
    f"model: {gb:.3f} GB; load ceiling {c['gbps']:.3f} GB/s ({c['seconds']:.3f} s, {c['bound']} bound): "
    f"read {c['fio']['seconds']:.3f} s (fio {c['fio']['gbps']:.3f} GB/s, busy CPU {c['fio']['busy_cpu_seconds']:.3f} s), "
    f"fault {c['fault']['seconds']:.3f} s ({c['fault']['pages']}, busy CPU {c['fault']['busy_cpu_seconds']:.3f} s), "
    f"cpu {c['cpu']['seconds']:.3f} s",
    f"load: median of 3 {med:.3f} s = {gb / med:.3f} GB/s = {gb / med / c['gbps']:.3f} of the load ceiling; "
    f"open {statistics.median(v['open_seconds'] for v in loads):.4f} s, engine {statistics.median(v['engine_seconds'] for v in loads):.4f} s, "
    f"process CPU {statistics.median(v['cpu_seconds_per_gb'] for v in loads):.3f} s/GB",
]
vm = dict(l.split() for l in open(f"{out}/vmstat.txt"))
lines.append("one load, machine-wide: " + ", ".join(f"{k} {v}" for k, v in vm.items()))
t = open(f"{out}/time.txt").read()
pick = lambda k: (re.search(rf"{k}: (\d+)", t) or [None, "?"])[1]
lines.append(
    f"/usr/bin/time: minor faults {pick('Minor .reclaiming a frame. page faults')}, voluntary switches "
    f"{pick('Voluntary context switches')}, involuntary {pick('Involuntary context switches')}"
)
calls = 0
rows = []
for l in open(f"{out}/strace.txt"):
    p = l.split()
    if len(p) >= 5 and p[0][0].isdigit() and p[-1] not in ("total",):
        n = int(p[3])
        calls += n
        rows.append((n, p[-1]))
rows.sort(reverse=True)
lines.append(f"syscalls: {calls} in one load = {calls / gb:.0f} per GB; most: " + ", ".join(f"{s} {n}" for n, s in rows[:6]))
lines.append("threads at the end (sum_exec_runtime ms, switches):")
lines += ["  " + l for l in open(f"{out}/sched.txt").read().splitlines()]
lines.append("CPU samples by thread (perf, every CPU):")
lines += ["  " + l.strip() for l in open(f"{out}/perf-comm.txt").read().splitlines()[:10]]
open(f"{out}/summary.txt", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF

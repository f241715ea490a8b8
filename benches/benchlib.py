#!/usr/bin/env python3
"""What the benchmarks share, one copy each: this process's CPU and
memory, the machine's busy CPU and page cache, and the meta.json that says
what a run was (machine, build, settings).

In an arm (benches/*/arm.py, benches/dist/rank.py), beside this file's
folder:

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import benchlib

From a bench script (benches/machine.sh's `write_meta` calls it):

    benchlib.py meta OUT [KEY=TEXT | KEY:=JSON | KEY@=WORDS]...

writes OUT with date, kernel, cpus, cpu_model, git, git_dirty,
page_reporting_order and keep_page_reporting (from the environment
machine.sh leaves: WS_META_PAGE_REPORTING, KEEP_PAGE_REPORTING), then each
KEY: TEXT as a string, JSON as parsed (a number, true, a list), WORDS
split at white space into a list of strings.
"""

import json
import os
import resource
import subprocess
import sys


def cpu_seconds():
    """This process's CPU seconds, user and system, every thread."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def peak_rss():
    """This process's peak resident set, bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_now():
    """This process's resident set now, bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def status_bytes(field):
    """A `kB` field of /proc/self/status (VmHWM, VmRSS, ...), in bytes; 0
    when absent."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def busy_ticks():
    """The machine's busy CPU time and, of it, the host's steal, clock
    ticks: user + nice + system + irq + softirq + steal of /proc/stat's
    `cpu` line (idle and iowait left out; guest time is already inside
    user), and steal alone."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (v + [0] * 8)[:8]
    return user + nice + system + irq + softirq + steal, steal


def page_cache_bytes():
    """The page cache (/proc/meminfo's Cached), bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Cached:"):
                return int(line.split()[1]) * 1024
    return 0


def _sh(*cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()
    except Exception:  # noqa: BLE001 - a missing tool leaves the field empty
        return None


def machine_meta():
    """The fields every record's meta.json has."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cpu_model = None
    try:
        with open("/proc/cpuinfo") as f:
            cpu_model = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), None)
    except OSError:
        pass
    reporting = os.environ.get("WS_META_PAGE_REPORTING") or None
    return {
        "date": _sh("date", "-Is"),
        "kernel": os.uname().release,
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model,
        "git": _sh("git", "-C", root, "rev-parse", "HEAD"),
        "git_dirty": bool(_sh("git", "-C", root, "status", "--porcelain")),
        "page_reporting_order": reporting,
        "keep_page_reporting": os.environ.get("KEEP_PAGE_REPORTING", "0") == "1",
    }


def parse_field(arg):
    """KEY=TEXT, KEY:=JSON or KEY@=WORDS as (key, value): the first "="
    ends the key, and a ":" or "@" just before it says the kind."""
    key, found, value = arg.partition("=")
    kind = key[-1:] if key[-1:] in (":", "@") else ""
    key = key[: len(key) - len(kind)]
    if not found or not key:
        raise SystemExit(f"benchlib.py meta: {arg!r} is not KEY=TEXT, KEY:=JSON or KEY@=WORDS")
    if kind == "@":
        return key, value.split()
    if kind == ":":
        try:
            return key, json.loads(value)
        except ValueError as e:
            raise SystemExit(f"benchlib.py meta: {arg!r}: not JSON ({e})") from None
    return key, value


def write_meta(path, fields):
    meta = machine_meta()
    meta.update(fields)
    with open(path, "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")


def main(argv):
    if len(argv) < 2 or argv[0] != "meta":
        raise SystemExit(__doc__)
    write_meta(argv[1], dict(parse_field(a) for a in argv[2:]))


if __name__ == "__main__":
    main(sys.argv[1:])

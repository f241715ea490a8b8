# Sourced by the benchmark scripts (bash): a cold cache, the machine made
# quiet for a run and put back as it was after, the simulated drives'
# tool, and the record's meta.json.
#
#   $simdrives        set on sourcing: SIMDRIVES, else ../shared/tools/simdrives
#                     beside the checkout, else the vendored ci/simdrives
#   write_meta OUT [KEY=TEXT | KEY:=JSON | KEY@=WORDS]...
#                     OUT: the machine, the build (git, dirty), free page
#                     reporting as machine_save found it, then each field
#                     (benches/benchlib.py meta)
#   machine_save      remember vm.nr_hugepages and free page reporting
#   machine_quiet     640 huge pages in the hugetlb pool (fio's and the
#                     ceiling's buffers), free page reporting off (order 11:
#                     no free block that large) unless KEEP_PAGE_REPORTING=1
#   machine_restore   both as machine_save found them
#   machine_take NAME simulated drives under a base and cgroup of our own
#                     (/tmp/NAME, NAME: another run's drives are left
#                     alone), torn down and the machine restored at exit
#                     (a trap on EXIT), then machine_quiet; needs $simdrives
#   cold              sync; drop the page cache
#   bare_read_sweep OUT FRESH_READ [ARGS...] [--] FILE...
#                     the bare read's configuration (benches/peers/fresh_read.c):
#                     each threads x block of FRESH_SWEEP (default: 2, 4 and 8
#                     threads x 1, 4, 8 and 16 MiB) once, cold, every result a line of
#                     OUT; the best left in $fresh_threads and $fresh_block
#
# Free page reporting: a VM's guest tells its host which pages are free; the
# host drops them, and the next first touch of such a page is an EPT fault
# and a clear on the host (clear_page was 91% of a load that took 4.1 s of
# CPU instead of 0.1 s). Which arm pays it depends on the reporting worker's
# timing, not on the arm. Bare metal has no such parameter.

reporting=/sys/module/page_reporting/parameters/page_reporting_order
bench_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
simdrives=${SIMDRIVES:-$bench_root/../shared/tools/simdrives}
[ -x "$simdrives" ] || simdrives=$bench_root/ci/simdrives

write_meta() {
    local out=$1
    shift
    WS_META_PAGE_REPORTING=${old_reporting:-} python3 "$bench_root/benches/benchlib.py" meta "$out" "$@"
}

cold() { sync; echo 3 > /proc/sys/vm/drop_caches; }

machine_save() {
    old_huge=$(cat /proc/sys/vm/nr_hugepages)
    old_reporting=$(cat "$reporting" 2>/dev/null || true)
}

machine_restore() {
    echo "$old_huge" > /proc/sys/vm/nr_hugepages
    [ -n "$old_reporting" ] && echo "$old_reporting" > "$reporting"
    return 0
}

machine_quiet() {
    echo 640 > /proc/sys/vm/nr_hugepages
    if [ -n "$old_reporting" ] && [ "${KEEP_PAGE_REPORTING:-0}" != 1 ]; then
        echo 11 > "$reporting"
        echo "free page reporting off for the run (page_reporting_order $old_reporting -> 11; KEEP_PAGE_REPORTING=1 keeps it)"
    fi
}

machine_take() {
    export SIMDRIVES_BASE=/tmp/$1 SIMDRIVES_CGROUP=$1
    machine_save
    trap machine_give_back EXIT
    machine_give_back
    machine_quiet
}

machine_give_back() {
    "$simdrives" down >/dev/null 2>&1 || true
    machine_restore
}

bare_read_sweep() {
    local out=$1 fr=$2 cfg t b v g best=0 opts=()
    shift 2
    while [ $# -gt 0 ] && [ "$1" != -- ]; do opts+=("$1"); shift; done
    [ "${1:-}" = -- ] && shift
    fresh_threads=8 fresh_block=$((4 << 20))
    : > "$out"
    for cfg in ${FRESH_SWEEP:-2x1M 4x1M 8x1M 2x4M 4x4M 8x4M 2x8M 4x8M 8x8M 2x16M 4x16M 8x16M}; do
        t=${cfg%x*} b=${cfg#*x}
        b=$(( ${b%M} << 20 ))
        cold
        v=$("$fr" "${opts[@]}" -b "$b" "$t" 1 "$@")
        echo "$v" >> "$out"
        g=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["gbps"])' "$v")
        echo "  bare read sweep: $t threads x $((b >> 20)) MiB: $g GB/s"
        if python3 -c 'import sys; sys.exit(0 if float(sys.argv[1]) > float(sys.argv[2]) else 1)' "$g" "$best"; then
            best=$g fresh_threads=$t fresh_block=$b
        fi
    done
    echo "  bare read: $fresh_threads threads x $((fresh_block >> 20)) MiB in every round"
}

// The clocks the benchmarks' C programs share (benches/peers/fresh_read.c,
// benches/scaling/rates.c, benches/contention/faultloop.c): one copy.
#ifndef WS_BENCH_CLOCK_H
#define WS_BENCH_CLOCK_H

#include <sys/resource.h>
#include <time.h>

// Seconds on the monotonic clock (wall time, never set back).
static inline double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

// This process's CPU seconds, user and system, every thread.
static inline double cpu_seconds(void) {
    struct rusage u;
    getrusage(RUSAGE_SELF, &u);
    return u.ru_utime.tv_sec + u.ru_utime.tv_usec * 1e-6 + u.ru_stime.tv_sec + u.ru_stime.tv_usec * 1e-6;
}

#endif

/* The per-core rates the scaling model (docs/benchmarks/DATE-scaling) is built
 * from, measured on this machine:
 *
 *   clear    first touch of fresh anonymous memory (the kernel clears each
 *            page as it faults in), one write per page, on 2 MiB pages
 *            (MADV_HUGEPAGE) and on 4 KiB pages (MADV_NOHUGEPAGE)
 *   copy     memcpy from one written buffer into another written buffer
 *            (a staging copy), 4 MiB at a time
 *
 * each with THREADS threads (1 and the machine's CPUs by default), each
 * thread on its own BYTES / THREADS, GB/s over the wall clock and per
 * thread, with the process's CPU seconds. Best of REPS repetitions, each
 * on memory of its own (fresh for clear).
 *
 *   cc -O2 -pthread -o rates rates.c
 *   rates [BYTES] [REPS] [THREADS...]        -> one JSON object on stdout
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "../clock.h"

#define HUGE (2L << 20)
#define PIECE (4L << 20)

struct job {
    char *dst, *src;
    long n;
    int op; /* 0: clear (touch), 1: copy */
};

static void *run(void *arg) {
    struct job *j = arg;
    if (j->op == 0) {
        for (long at = 0; at < j->n; at += 4096)
            j->dst[at] = 1;
    } else {
        for (long at = 0; at < j->n; at += PIECE) {
            long k = j->n - at < PIECE ? j->n - at : PIECE;
            memcpy(j->dst + at, j->src + at, k);
        }
    }
    return NULL;
}

/* n bytes on a 2 MiB boundary; *raw is the mapping (n + 2 MiB) to unmap. */
static char *map(long n, int huge, char **raw) {
    *raw = mmap(NULL, n + HUGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (*raw == MAP_FAILED) {
        perror("rates: mmap");
        exit(1);
    }
    char *p = (char *)(((long)*raw + HUGE - 1) & ~(HUGE - 1));
    madvise(p, n, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    return p;
}

/* One measurement: GB/s over the wall clock, and CPU seconds per GB. */
static void measure(const char *what, int op, int huge, long bytes, int threads, int reps, int first) {
    double best = 0, best_cpu = 0;
    long per = bytes / threads / PIECE * PIECE;
    long n = per * threads;
    for (int r = 0; r < reps; r++) {
        char *dst_raw, *src_raw = NULL;
        char *dst = map(n, huge, &dst_raw), *src = NULL;
        if (op == 1) {
            src = map(n, huge, &src_raw);
            memset(src, 7, n);
            memset(dst, 0, n);
        }
        pthread_t t[64];
        struct job jobs[64];
        double c0 = cpu_seconds(), t0 = now();
        for (int i = 0; i < threads; i++) {
            jobs[i] = (struct job){dst + i * per, src ? src + i * per : NULL, per, op};
            pthread_create(&t[i], NULL, run, &jobs[i]);
        }
        for (int i = 0; i < threads; i++)
            pthread_join(t[i], NULL);
        double dt = now() - t0, cpu = cpu_seconds() - c0;
        if (n / dt / 1e9 > best) {
            best = n / dt / 1e9;
            best_cpu = cpu / (n / 1e9);
        }
        munmap(dst_raw, n + HUGE);
        if (src_raw)
            munmap(src_raw, n + HUGE);
    }
    printf("%s{\"what\": \"%s\", \"pages\": \"%s\", \"threads\": %d, \"bytes\": %ld, \"gbps\": %.3f, "
           "\"gbps_per_thread\": %.3f, \"cpu_seconds_per_gb\": %.4f}",
           first ? "" : ", ", what, huge ? "2M" : "4K", threads, n, best, best / threads, best_cpu);
}

int main(int argc, char **argv) {
    long bytes = argc > 1 ? atol(argv[1]) : (2L << 30);
    int reps = argc > 2 ? atoi(argv[2]) : 3;
    int ncpu = (int)sysconf(_SC_NPROCESSORS_ONLN);
    int threads[16], nt = 0;
    for (int i = 3; i < argc && nt < 16; i++)
        threads[nt++] = atoi(argv[i]);
    if (!nt) {
        threads[nt++] = 1;
        if (ncpu > 1)
            threads[nt++] = ncpu;
    }
    printf("{\"cpus\": %d, \"rates\": [", ncpu);
    int first = 1;
    for (int i = 0; i < nt; i++) {
        if (threads[i] < 1 || threads[i] > 64)
            continue;
        measure("clear", 0, 1, bytes, threads[i], reps, first);
        first = 0;
        measure("clear", 0, 0, bytes, threads[i], reps, 0);
        measure("copy", 1, 1, bytes, threads[i], reps, 0);
    }
    printf("]}\n");
    return 0;
}

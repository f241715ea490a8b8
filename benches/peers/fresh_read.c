/* The least a loader can do: read files O_DIRECT into one fresh anonymous
 * mapping (transparent huge pages, faulted by the reads themselves), with
 * THREADS threads each reading blocks of BLOCK bytes (default 4 MiB) with
 * pread, then PASSES - 1 more times into the same, now written, memory. No
 * tensors, no header: the files' bytes land back to back. It stands beside
 * the loaders in benches/peers.sh to say what this machine gives a read
 * into fresh memory, which fio (its buffers are a few, reused) does not
 * measure.
 *
 *   cc -O2 -pthread -o fresh_read fresh_read.c
 *   fresh_read [-b BLOCK] [-m COPIES] THREADS PASSES FILE...
 *                                          -> one JSON object on stdout
 *
 * -m COPIES: the FILE list is COPIES copies of the same files, one copy
 * after the other (the files of a model mirrored on COPIES drives); block
 * i of a file is read from copy i % COPIES, so every drive reads its share
 * at once, and the memory holds one copy.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "../clock.h"

#define HUGE (2L << 20)
#define MAX_FILES 256
#define MAX_COPIES 8

static long BS = 4L << 20;
static int copies = 1;
static int fds[MAX_COPIES][MAX_FILES];
static long sizes[MAX_FILES], starts[MAX_FILES];
static int nfiles;
static long total;
static char *buf;
static atomic_long next_block;
static atomic_long bytes_read;

static void *worker(void *arg) {
    (void)arg;
    for (;;) {
        long block = atomic_fetch_add(&next_block, 1);
        long off = block * BS;
        if (off >= total)
            return NULL;
        int f = 0;
        while (f < nfiles - 1 && off >= starts[f + 1])
            f++;
        long at = off - starts[f];
        long n = BS;
        if (at + n > sizes[f])
            n = sizes[f] - at; /* the file's tail: O_DIRECT reads it short */
        if (n <= 0)
            continue;
        long want = (n + 4095) & ~4095L;
        ssize_t got = pread(fds[block % copies][f], buf + off, want, at);
        if (got < 0) {
            fprintf(stderr, "fresh_read: pread: %s\n", strerror(errno));
            exit(1);
        }
        atomic_fetch_add(&bytes_read, got < n ? got : n);
    }
}

int main(int argc, char **argv) {
    int opt;
    while ((opt = getopt(argc, argv, "+b:m:")) != -1) {
        if (opt == 'b')
            BS = atol(optarg);
        else if (opt == 'm')
            copies = atoi(optarg);
        else
            return 2;
    }
    argc -= optind - 1;
    argv += optind - 1;
    if (argc < 4) {
        fprintf(stderr, "usage: fresh_read [-b BLOCK] [-m COPIES] THREADS PASSES FILE...\n");
        return 2;
    }
    int threads = atoi(argv[1]), passes = atoi(argv[2]);
    int names = argc - 3;
    if (threads < 1 || threads > 64 || passes < 1 || copies < 1 || copies > MAX_COPIES || names % copies ||
        names / copies > MAX_FILES || BS < 4096 || BS % 4096) {
        fprintf(stderr, "fresh_read: 1-64 threads, 1 or more passes, 1-%d copies of at most %d files each, "
                        "a block of whole 4 KiB pages\n", MAX_COPIES, MAX_FILES);
        return 2;
    }
    nfiles = names / copies;
    for (int c = 0; c < copies; c++) {
        for (int i = 0; i < nfiles; i++) {
            const char *name = argv[3 + c * nfiles + i];
            fds[c][i] = open(name, O_RDONLY | O_DIRECT);
            struct stat st;
            if (fds[c][i] < 0 || fstat(fds[c][i], &st) < 0) {
                fprintf(stderr, "fresh_read: %s: %s\n", name, strerror(errno));
                return 1;
            }
            if (c == 0) {
                sizes[i] = st.st_size;
                starts[i] = total;
                total += (st.st_size + BS - 1) / BS * BS; /* each file starts a block */
            } else if (st.st_size != sizes[i]) {
                fprintf(stderr, "fresh_read: %s: not the size of %s\n", name, argv[3 + i]);
                return 1;
            }
        }
    }
    char *raw = mmap(NULL, total + HUGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) {
        perror("fresh_read: mmap");
        return 1;
    }
    buf = (char *)(((long)raw + HUGE - 1) & ~(HUGE - 1));
    madvise(buf, total, MADV_HUGEPAGE);
    struct rusage ru0;
    getrusage(RUSAGE_SELF, &ru0);
    double first_s = 0, first_cpu = 0;
    long first_b = 0;
    char passes_json[64 * 200] = "";
    for (int p = 0; p < passes && p < 64; p++) {
        atomic_store(&next_block, 0);
        atomic_store(&bytes_read, 0);
        pthread_t t[64];
        double c0 = cpu_seconds(), t0 = now();
        for (int i = 0; i < threads; i++)
            pthread_create(&t[i], NULL, worker, NULL);
        for (int i = 0; i < threads; i++)
            pthread_join(t[i], NULL);
        double dt = now() - t0, cpu = cpu_seconds() - c0;
        long b = atomic_load(&bytes_read);
        if (p == 0) {
            first_s = dt;
            first_cpu = cpu;
            first_b = b;
        }
        size_t at = strlen(passes_json);
        snprintf(passes_json + at, sizeof passes_json - at,
                 "%s{\"memory\": \"%s\", \"bytes\": %ld, \"seconds\": %.6f, \"gbps\": %.4f, \"cpu_seconds\": %.4f}",
                 p ? ", " : "", p ? "written" : "fresh", b, dt, b / dt / 1e9, cpu);
    }
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    /* The first pass is the figure: a read into fresh memory. */
    printf("{\"arm\": \"fresh-read\", \"threads\": %d, \"block\": %ld, \"copies\": %d, \"bytes\": %ld, \"seconds\": %.6f, "
           "\"gbps\": %.4f, \"cpu_seconds\": %.4f, \"cpu_seconds_per_gb\": %.4f, \"peak_rss_bytes\": %ld, "
           "\"rss_start_bytes\": %ld, \"passes\": [%s]}\n",
           threads, BS, copies, first_b, first_s, first_b / first_s / 1e9, first_cpu, first_cpu / (first_b / 1e9),
           ru.ru_maxrss * 1024L, ru0.ru_maxrss * 1024L, passes_json);
    return 0;
}

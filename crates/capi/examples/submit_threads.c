/* Submission from many threads through the C ABI: T threads share one
 * engine and one registered memory (each its own region), and each keeps
 * one read of RANGE bytes in flight at a time (submit, wait, again), over
 * the model's tensors in turn, for SECONDS. Prints one JSON line: reads per
 * second and GB/s. benches/capi-decode.sh runs it for 1, 2, 4 and 8 threads:
 * the rate grows with threads until the drive (or the CPUs) is the limit,
 * because no lock of the library is held across a read.
 *
 *   submit_threads MODEL_DIR THREADS [SECONDS [RANGE_BYTES]]   (defaults 2, 65536) */
#define _GNU_SOURCE
#include <weightstream.h>

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define TRY(call) do { ws_status s_ = (call); if (s_ != WS_OK) { \
    fprintf(stderr, "%s: %s: %s\n", #call, ws_status_name(s_), ws_last_error()); exit(1); } } while (0)

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

struct shared {
    ws_model m;
    ws_engine e;
    ws_memory mem;
    size_t region, n, range;
    const size_t *big; /* tensors of at least `range` bytes */
    size_t nbig;
    double until;
    atomic_ullong reads, bytes;
};

struct worker {
    struct shared *s;
    int id;
};

static void *run(void *arg) {
    struct worker *w = arg;
    struct shared *s = w->s;
    unsigned long long reads = 0, bytes = 0;
    size_t k = (size_t)w->id;
    while (now() < s->until) {
        ws_read r = {.tensor = s->big[k % s->nbig], .start = 0, .end = s->range, .at = (size_t)w->id * s->region,
                     .scratch = WS_SCRATCH_NONE, .flags = 0};
        ws_ticket t;
        ws_read_result res;
        TRY(ws_read_into(s->e, s->mem, &r, &t));
        TRY(ws_ticket_wait(t, UINT64_MAX, &res));
        reads++;
        bytes += res.bytes;
        k += 7;
    }
    atomic_fetch_add(&s->reads, reads);
    atomic_fetch_add(&s->bytes, bytes);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s MODEL_DIR THREADS [SECONDS [RANGE_BYTES]]\n", argv[0]);
        return 2;
    }
    int threads = atoi(argv[2]);
    double secs = argc > 3 ? atof(argv[3]) : 2.0;
    struct shared s = {.range = argc > 4 ? (size_t)atoll(argv[4]) : 65536};
    if (threads < 1 || threads > 256 || s.range == 0) return 2;
    TRY(ws_model_open_env(argv[1], &s.m));
    TRY(ws_engine_create_env(s.m, &s.e));
    TRY(ws_model_tensor_count(s.m, &s.n));
    size_t *big = calloc(s.n, sizeof *big);
    for (size_t i = 0; i < s.n; i++) {
        ws_tensor_info t;
        TRY(ws_model_tensor(s.m, i, &t));
        if (t.bytes >= s.range) big[s.nbig++] = i;
    }
    if (s.nbig == 0) { fprintf(stderr, "no tensor of %zu bytes\n", s.range); return 1; }
    s.big = big;
    /* Each thread's region: the range, its phase and a block either side. */
    s.region = (s.range + 3 * 4096 + 4095) & ~(size_t)4095;
    size_t len = s.region * (size_t)threads;
    void *buf = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (buf == MAP_FAILED) return 1;
    TRY(ws_memory_register(s.e, buf, len, &s.mem));
    pthread_t th[256];
    struct worker w[256];
    double t0 = now();
    s.until = t0 + secs;
    for (int i = 0; i < threads; i++) {
        w[i] = (struct worker){.s = &s, .id = i};
        pthread_create(&th[i], NULL, run, &w[i]);
    }
    for (int i = 0; i < threads; i++) pthread_join(th[i], NULL);
    double el = now() - t0;
    unsigned long long reads = atomic_load(&s.reads), bytes = atomic_load(&s.bytes);
    printf("{\"threads\": %d, \"range\": %zu, \"seconds\": %.3f, \"reads\": %llu, \"reads_per_s\": %.0f, \"gbps\": %.4f}\n",
           threads, s.range, el, reads, (double)reads / el, (double)bytes / 1e9 / el);
    TRY(ws_memory_unregister(s.mem, 60000));
    munmap(buf, len);
    TRY(ws_engine_shutdown(s.e, 10000, NULL));
    TRY(ws_model_close(s.m));
    free(big);
    return 0;
}

/* A decode loop over the C ABI, as the engines of docs/FIELD-NOTES do it:
 * each step, for every layer, pick k experts, read their gate, up and down
 * projections into the engine's own page-aligned buffers (one registered
 * region, the payloads placed in phase so every read is in place and
 * O_DIRECT), wait for the layer, check, go on.
 *
 *   decode MODEL_DIR [STEPS [K [VERIFY]]]     (defaults 8, 2, 1)
 *
 * VERIFY 1 compares every payload with the file's bytes (pread) after the
 * clock; 0 only reads. Prints one line: steps, bytes, seconds, GB/s, CPU
 * seconds per GB (this process, I/O threads included). Its twin in Rust,
 * examples/decode.rs, reads the same experts in the same order through
 * the Rust API (benches/capi-decode.sh runs both, interleaved). Build:
 *   cc decode.c $(pkg-config --cflags --libs weightstream) -o decode */
#define _GNU_SOURCE
#include <weightstream.h>

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#define DIE(...) do { fprintf(stderr, __VA_ARGS__); fprintf(stderr, ": %s\n", ws_last_error()); exit(1); } while (0)
#define TRY(call) do { ws_status s_ = (call); if (s_ != WS_OK) DIE("%s: %s", #call, ws_status_name(s_)); } while (0)

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static double cpu(void) {
    struct rusage r;
    getrusage(RUSAGE_SELF, &r);
    return (double)r.ru_utime.tv_sec + (double)r.ru_utime.tv_usec * 1e-6 + (double)r.ru_stime.tv_sec +
           (double)r.ru_stime.tv_usec * 1e-6;
}

/* Does `got` hold the file's bytes? The shard's path is the model folder
 * plus its name, found through the tensor's shard index and a listing. */
static int verify(const char *dir, const ws_tensor_info *t, const unsigned char *got) {
    char path[4096];
    snprintf(path, sizeof path, "%s/model-%05u-of-", dir, t->shard + 1);
    /* The shard count is in the name: find the file by prefix. */
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "ls %s*.safetensors 2>/dev/null", path);
    FILE *p = popen(cmd, "r");
    char file[4096] = "";
    if (!p || !fgets(file, sizeof file, p)) { if (p) pclose(p); return 0; }
    pclose(p);
    file[strcspn(file, "\n")] = 0;
    int fd = open(file, O_RDONLY | O_CLOEXEC);
    unsigned char *want = malloc(t->bytes);
    int ok = fd >= 0 && want && pread(fd, want, t->bytes, (off_t)t->file_offset) == (ssize_t)t->bytes &&
             memcmp(want, got, t->bytes) == 0;
    free(want);
    if (fd >= 0) close(fd);
    return ok;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s MODEL_DIR [STEPS [K [VERIFY]]]\n", argv[0]);
        return 2;
    }
    const char *dir = argv[1];
    int steps = argc > 2 ? atoi(argv[2]) : 8;
    int k = argc > 3 ? atoi(argv[3]) : 2;
    int check = argc > 4 ? atoi(argv[4]) : 1;
    ws_model model;
    ws_engine engine;
    TRY(ws_model_open_env(dir, &model));
    TRY(ws_engine_create_env(model, &engine));

    /* The model's shape: layers and experts per layer, from the names. */
    int layers = 0, experts = 0;
    char name[256];
    for (;;) {
        ws_tensor_info t;
        snprintf(name, sizeof name, "model.layers.%d.mlp.experts.0.gate_proj.weight", layers);
        if (ws_model_find(model, name, &t) != WS_OK) break;
        layers++;
    }
    for (;;) {
        ws_tensor_info t;
        snprintf(name, sizeof name, "model.layers.0.mlp.experts.%d.gate_proj.weight", experts);
        if (ws_model_find(model, name, &t) != WS_OK) break;
        experts++;
    }
    if (layers == 0 || experts == 0) DIE("%s: no model.layers.L.mlp.experts.E.*_proj.weight tensors", dir);
    if (k > experts) k = experts;

    /* One layer's reads at a time: 3k tensors. The buffer holds the
     * largest such set, placed by the library (every read in place). */
    static const char *proj[3] = {"gate_proj", "up_proj", "down_proj"};
    size_t n = (size_t)(3 * k);
    size_t *idx = calloc(n, sizeof *idx), *at = calloc(n, sizeof *at);
    ws_read *reads = calloc(n, sizeof *reads);
    ws_ticket *tickets = calloc(n, sizeof *tickets);
    ws_tensor_info *info = calloc(n, sizeof *info);
    uint64_t largest = 0;
    for (int l = 0; l < layers; l++)
        for (int e = 0; e < experts; e++)
            for (int p = 0; p < 3; p++) {
                ws_tensor_info t;
                snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.%s.weight", l, e, proj[p]);
                TRY(ws_model_find(model, name, &t));
                if (t.bytes > largest) largest = t.bytes;
            }
    size_t align = 0;
    TRY(ws_engine_direct_align(engine, &align));
    size_t len = n * ((size_t)largest + 2 * align) + align;
    len = (len + 4095) & ~(size_t)4095;
    void *buf = NULL;
    if (posix_memalign(&buf, 2 << 20, len) != 0) DIE("posix_memalign %zu", len);
    memset(buf, 0, len); /* the engine's buffer, faulted once, reused every step */
    ws_memory mem;
    TRY(ws_memory_register(engine, buf, len, &mem));

    /* The router: a 64-bit LCG (Knuth's MMIX constants), the same in the
     * Rust twin (examples/decode.rs), so both read the same experts. */
    uint64_t seed = 1;
    uint64_t bytes = 0;
    size_t bad = 0, checked = 0;
    double cpu0 = cpu(), t0 = now(), busy = 0;
    for (int s = 0; s < steps; s++) {
        for (int l = 0; l < layers; l++) {
            /* The router's pick: k distinct experts. */
            int pick[64];
            for (int j = 0; j < k && j < 64; j++) {
                int e, dup;
                do {
                    seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
                    e = (int)((seed >> 33) % (uint64_t)experts);
                    dup = 0;
                    for (int q = 0; q < j; q++) dup |= pick[q] == e;
                } while (dup);
                pick[j] = e;
                for (int p = 0; p < 3; p++) {
                    snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.%s.weight", l, e, proj[p]);
                    TRY(ws_model_find(model, name, &info[3 * j + p]));
                    idx[3 * j + p] = info[3 * j + p].index;
                }
            }
            TRY(ws_memory_placement(mem, idx, n, at));
            for (size_t i = 0; i < n; i++) {
                ws_read r = {.tensor = idx[i], .start = 0, .end = 0, .at = at[i], .scratch = WS_SCRATCH_BLOCKS, .flags = WS_READ_IN_PLACE};
                reads[i] = r;
            }
            TRY(ws_read_batch(engine, mem, reads, n, tickets));
            for (size_t i = 0; i < n; i++) {
                ws_read_result res;
                TRY(ws_ticket_wait(tickets[i], UINT64_MAX, &res));
                bytes += res.bytes;
            }
            if (check) {
                double c0 = now();
                for (size_t i = 0; i < n; i++) {
                    checked++;
                    if (!verify(dir, &info[i], (unsigned char *)buf + at[i])) bad++;
                }
                busy += now() - c0; /* checking is not timed */
            }
        }
    }
    double secs = now() - t0 - busy;
    double cpu_s = cpu() - cpu0;
    ws_stats st;
    TRY(ws_engine_stats(engine, &st));
    printf("{\"steps\": %d, \"layers\": %d, \"k\": %d, \"bytes\": %llu, \"seconds\": %.6f, \"gbps\": %.4f, "
           "\"cpu_s_per_gb\": %.4f, \"verified\": %zu, \"bad\": %zu, \"fallbacks\": %llu, \"staged\": %llu}\n",
           steps, layers, k, (unsigned long long)bytes, secs, (double)bytes / 1e9 / secs,
           check ? -1.0 : cpu_s / ((double)bytes / 1e9), checked, bad, (unsigned long long)st.fallbacks,
           (unsigned long long)st.staged_reads);
    TRY(ws_memory_unregister(mem, 60000));
    free(buf);
    ws_shutdown_report rep;
    TRY(ws_engine_shutdown(engine, 10000, &rep));
    TRY(ws_model_close(model));
    free(idx); free(at); free(reads); free(tickets); free(info);
    return bad || st.fallbacks ? 1 : 0;
}

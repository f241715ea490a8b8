/* A MoE decode loop over the C ABI's expert cache: each step, for every
 * layer, the router picks k experts (skewed: a few are hot); the layer's
 * top-k are got at once (misses read O_DIRECT in place, striped over the
 * drives), the next layer's guess is prefetched while this one "computes",
 * and the handles are released when the layer is done.
 *
 *   expert_cache MODEL_DIR [STEPS [K [CAPACITY]]]     (defaults 8, 2, 8)
 *
 * Prints the cache's counters. Build:
 *   cc expert_cache.c $(pkg-config --cflags --libs weightstream) -o expert_cache */
#define _GNU_SOURCE
#include <weightstream.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DIE(...) do { fprintf(stderr, __VA_ARGS__); fprintf(stderr, ": %s\n", ws_last_error()); exit(1); } while (0)
#define TRY(call) do { ws_status s_ = (call); if (s_ != WS_OK) DIE("%s: %s", #call, ws_status_name(s_)); } while (0)
#define MAX_K 16
#define MAX_PARTS 16

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint64_t next(void) { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; return rng; }

/* Expert e with weight about 1/(e+1): a few hot experts, a long tail. */
static uint32_t pick(uint32_t experts) {
    for (;;) {
        uint32_t e = (uint32_t)(next() % experts);
        if (next() % (e + 1) == 0) return e;
    }
}

/* The part is the model's tensor, whole (ci/capi's test suite compares
 * every byte with the file's). */
static void check_part(ws_model m, const ws_expert_part *p) {
    ws_tensor_info t;
    TRY(ws_model_find(m, p->tensor, &t));
    if (t.bytes != p->bytes || (p->bytes && !p->data)) DIE("%s: %llu bytes", p->tensor, (unsigned long long)p->bytes);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s MODEL_DIR [STEPS [K [CAPACITY]]]\n", argv[0]);
        return 2;
    }
    const char *dir = argv[1];
    int steps = argc > 2 ? atoi(argv[2]) : 8;
    int k = argc > 3 ? atoi(argv[3]) : 2;
    uint64_t capacity = argc > 4 ? strtoull(argv[4], NULL, 10) : 8;
    if (k < 1 || k > MAX_K) DIE("K from 1 to %d", MAX_K);
    ws_model m;
    TRY(ws_model_open(dir, NULL, &m));
    /* Layers and experts per layer, from the names the model has. */
    size_t count;
    TRY(ws_model_tensor_count(m, &count));
    uint32_t layers = 0, experts = 0;
    for (size_t i = 0; i < count; i++) {
        ws_tensor_info t;
        TRY(ws_model_tensor(m, i, &t));
        unsigned l, e;
        if (sscanf(t.name, "model.layers.%u.mlp.experts.%u.", &l, &e) == 2) {
            if (l + 1 > layers) layers = l + 1;
            if (e + 1 > experts) experts = e + 1;
        }
    }
    if (!layers) DIE("no experts named model.layers.L.mlp.experts.E.* in %s", dir);
    if ((uint32_t)k > experts) k = (int)experts;

    ws_expert_cache_options o = ws_expert_cache_options_default();
    o.capacity_experts = capacity;
    ws_expert_cache cache;
    TRY(ws_expert_cache_create(m, &o, NULL, &cache));
    uint32_t chosen[MAX_K], guess[MAX_K];
    ws_expert held[MAX_K];
    for (int s = 0; s < steps; s++) {
        for (uint32_t l = 0; l < layers; l++) {
            int n = 0;
            while (n < k) {
                uint32_t e = pick(experts);
                int dup = 0;
                for (int i = 0; i < n; i++) dup |= chosen[i] == e;
                if (!dup) chosen[n++] = e;
            }
            ws_status st = ws_expert_cache_get_many(cache, l, chosen, (size_t)n, held);
            if (st == WS_ERR_BUSY) DIE("cache of %llu experts too small for k %d", (unsigned long long)capacity, k);
            TRY(st);
            /* While this layer computes, the next layer's likely experts load. */
            if (l + 1 < layers) {
                ws_expert_key keys[MAX_K];
                for (int i = 0; i < n; i++) {
                    guess[i] = pick(experts);
                    keys[i] = (ws_expert_key){l + 1, guess[i]};
                }
                TRY(ws_expert_cache_prefetch(cache, keys, (size_t)n, NULL));
            }
            for (int i = 0; i < n; i++) {
                ws_expert_part parts[MAX_PARTS];
                size_t np;
                TRY(ws_expert_parts(held[i], parts, MAX_PARTS, &np));
                for (size_t j = 0; j < np && j < MAX_PARTS; j++) check_part(m, &parts[j]);
                /* ... the expert's matmuls would run on parts[j].data here ... */
                TRY(ws_expert_release(held[i]));
            }
        }
    }
    ws_cache_stats st;
    TRY(ws_expert_cache_stats(cache, &st));
    printf("%d steps x %u layers, top-%d of %u, cache of %llu: hits %llu, misses %llu, prefetched %llu (used %llu, "
           "wasted %llu), %.1f MB read, waited %.3f s\n",
           steps, layers, k, experts, (unsigned long long)st.capacity, (unsigned long long)st.hits,
           (unsigned long long)st.misses, (unsigned long long)st.prefetched, (unsigned long long)st.prefetch_used,
           (unsigned long long)st.prefetch_wasted, st.bytes_read / 1e6, st.wait_seconds);
    TRY(ws_expert_cache_destroy(cache));
    TRY(ws_model_close(m));
    return 0;
}

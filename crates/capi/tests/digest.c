/* sha256 of every tensor read through the C ABI, as sha256sum prints
 * ("<hex>  <name>", name order): ci/capi compares it with what the Python
 * reference reader prints for shards the reference writer made
 * (tests/reference/ref_digest.py).
 *
 *   digest MODEL_DIR [MIRROR_DIR]
 *
 * With a mirror, reads are striped over both copies. Tensors alternate
 * between a placed, in-place O_DIRECT read (WS_SCRATCH_BLOCKS at the
 * placement's offset) and a read at an odd offset (staged, then copied). */
#define _GNU_SOURCE
#include "sha256.h"
#include "weightstream.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define TRY(call) do { ws_status s_ = (call); if (s_ != WS_OK) { \
    fprintf(stderr, "digest: %s: %s: %s\n", #call, ws_status_name(s_), ws_last_error()); return 1; } } while (0)

int main(int argc, char **argv) {
    if (argc < 2 || argc > 3) {
        fprintf(stderr, "usage: %s MODEL_DIR [MIRROR_DIR]\n", argv[0]);
        return 2;
    }
    sha256_ctx c;
    char hex[65];
    sha256_init(&c);
    sha256_update(&c, (const unsigned char *)"abc", 3);
    sha256_hex(&c, hex);
    if (strcmp(hex, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad") != 0) {
        fprintf(stderr, "digest: this sha256 is wrong: %s\n", hex);
        return 1;
    }
    ws_model_options o = ws_model_options_default();
    if (argc == 3) {
        o.mirrors = argv[2];
        o.route = "stripe";
    }
    ws_model m;
    ws_engine e;
    TRY(ws_model_open(argv[1], &o, &m));
    TRY(ws_engine_create(m, NULL, &e));
    size_t n = 0, align = 0;
    TRY(ws_model_tensor_count(m, &n));
    TRY(ws_engine_direct_align(e, &align));
    uint64_t biggest = 0;
    for (size_t i = 0; i < n; i++) {
        ws_tensor_info t;
        TRY(ws_model_tensor(m, i, &t));
        if (t.bytes > biggest) biggest = t.bytes;
    }
    size_t len = (((size_t)biggest + 3 * align) + 4095) & ~(size_t)4095;
    unsigned char *mem = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) return 1;
    ws_memory mh;
    TRY(ws_memory_register(e, mem, len, &mh));
    for (size_t i = 0; i < n; i++) {
        ws_tensor_info t;
        TRY(ws_model_tensor(m, i, &t));
        ws_read r = {.tensor = i, .start = 0, .end = 0, .at = 1, .scratch = WS_SCRATCH_NONE, .flags = 0};
        if (i % 2 == 0) {
            TRY(ws_memory_placement(mh, &i, 1, &r.at));
            r.scratch = WS_SCRATCH_BLOCKS;
        }
        ws_ticket tk;
        ws_read_result res;
        TRY(ws_read_into(e, mh, &r, &tk));
        TRY(ws_ticket_wait(tk, UINT64_MAX, &res));
        if (res.bytes != t.bytes) {
            fprintf(stderr, "digest: %s: %llu bytes read, %llu expected\n", t.name, (unsigned long long)res.bytes,
                    (unsigned long long)t.bytes);
            return 1;
        }
        sha256_init(&c);
        sha256_update(&c, mem + res.offset, (size_t)res.bytes);
        sha256_hex(&c, hex);
        printf("%s  %s\n", hex, t.name);
    }
    TRY(ws_memory_unregister(mh, 60000));
    munmap(mem, len);
    TRY(ws_engine_shutdown(e, 10000, NULL));
    TRY(ws_model_close(m));
    return 0;
}

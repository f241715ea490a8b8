// One tensor into memory of our own: read_tensor MODEL TENSOR
#include <stdio.h>
#include <stdlib.h>
#include <weightstream.h>

static int fail(void) { fprintf(stderr, "%s\n", ws_last_error()); return 1; }

int main(int argc, char **argv) {
    if (argc != 3) { fprintf(stderr, "usage: %s MODEL TENSOR\n", argv[0]); return 2; }
    ws_model model; ws_engine engine; ws_tensor_info t;
    if (ws_model_open(argv[1], NULL, &model) != WS_OK) return fail();
    if (ws_model_find(model, argv[2], &t) != WS_OK) return fail();
    if (ws_engine_create(model, NULL, &engine) != WS_OK) return fail();
    void *bytes = malloc(t.bytes + 1);
    if (bytes == NULL) { perror("malloc"); return 1; }
    ws_fill_target target = {.name = t.name, .dest = bytes, .len = t.bytes};
    if (ws_fill(engine, &target, 1, NULL, NULL) != WS_OK) return fail();
    printf("%s %s [", t.name, t.dtype);
    for (uint32_t i = 0; i < t.ndim; i++) printf("%s%llu", i ? ", " : "", (unsigned long long)t.shape[i]);
    printf("] %llu bytes\n", (unsigned long long)t.bytes);
    free(bytes);
    ws_engine_shutdown(engine, 10000, NULL);
    ws_model_close(model);
    return 0;
}

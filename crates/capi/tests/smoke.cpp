// The header from C++: compiled with -Wall -Wextra -Werror -pedantic by
// ci/capi and run on a model: every symbol links, the types are usable, and
// an error comes back as a code and a message.
#include <weightstream.h>

#include <cstdio>
#include <cstdlib>
#include <stdlib.h> // posix_memalign
#include <cstring>
#include <vector>

int main(int argc, char **argv) {
    if (argc != 2) {
        std::fprintf(stderr, "usage: %s MODEL_DIR\n", argv[0]);
        return 2;
    }
    if ((ws_abi_version() >> 16) != WS_ABI_VERSION_MAJOR) return 1;
    ws_model model{};
    if (ws_model_open("/nonexistent", nullptr, &model) != WS_ERR_IO || std::strlen(ws_last_error()) == 0) return 1;
    ws_model_options opts = ws_model_options_default();
    if (ws_model_open(argv[1], &opts, &model) != WS_OK) return 1;
    ws_engine engine{};
    ws_engine_options eopts = ws_engine_options_default();
    if (ws_engine_create(model, &eopts, &engine) != WS_OK) return 1;
    size_t n = 0;
    ws_model_tensor_count(model, &n);
    ws_tensor_info t{};
    if (n == 0 || ws_model_tensor(model, 0, &t) != WS_OK) return 1;
    size_t len = ((static_cast<size_t>(t.bytes) + 2 * 4096) + 4095) & ~static_cast<size_t>(4095);
    void *mem = nullptr;
    if (posix_memalign(&mem, 4096, len) != 0) return 1;
    ws_memory m{};
    if (ws_memory_register(engine, mem, len, &m) != WS_OK) return 1;
    ws_read r{t.index, 0, 0, 0, WS_SCRATCH_NONE, 0};
    ws_ticket tk{};
    ws_read_result res{};
    if (ws_read_into(engine, m, &r, &tk) != WS_OK || ws_ticket_wait(tk, UINT64_MAX, &res) != WS_OK) return 1;
    if (res.bytes != t.bytes) return 1;
    // t.name lives as long as the model (or an engine made from it): print
    // it while both are open.
    std::printf("smoke (C++): %s, %zu tensors, read %s\n", ws_version(), n, t.name);
    if (ws_memory_unregister(m, 10000) != WS_OK) return 1;
    std::free(mem);
    ws_shutdown_report rep{};
    if (ws_engine_shutdown(engine, 10000, &rep) != WS_OK || rep.drained != 1) return 1;
    if (ws_model_close(model) != WS_OK) return 1;
    return 0;
}

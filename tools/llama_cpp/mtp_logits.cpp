// llama-mtp-logits: run llama.cpp's DeepSeek V4 MTP block (its DECODER_MTP graph) step by step.
//
//   llama-mtp-logits MODEL.mtp.llama.gguf IN.bin OUT.bin [n_threads]
//
// MODEL: an MTP-only GGUF from tools/llama_cpp/mtp_for_llama.py. IN.bin (little-endian):
//   int32 n_steps, int32 n_embd_out (= n_hc * n_embd), then per step
//   int32 token, int32 pos, float32 h[n_embd_out] (the HC state the block starts from).
// Each step is one llama_decode of one token on an MTP context (its own KV cache, sequence 0),
// so step i attends over the rows of steps 0..i, as ds4ref's mtp_draft_step on one LayerCache.
// OUT.bin: per step float32 logits[n_vocab], then float32 h_next[n_embd_out] (the block's
// output HC state, llama.cpp's "h_nextn"). Written against llama.h / llama-ext.h only.
// With LLAMA_MTP_DUMP=FILE, every contiguous F32 tensor the graph computes in step 0 is written
// to FILE as records: char name[64], int64 ne[4], float32 data (the per-stage diagnosis).
#include "llama.h"
#include "llama-ext.h"
#include "ggml.h"
#include "ggml-backend.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

static void die(const char * what) {
    fprintf(stderr, "llama-mtp-logits: %s\n", what);
    exit(1);
}

static FILE * g_dump = nullptr;
static bool g_step0 = true;

static bool dump_cb(struct ggml_tensor * t, bool ask, void *) {
    if (ask) return g_dump && g_step0;
    if (t->type != GGML_TYPE_F32 || !ggml_is_contiguous(t)) return true;
    std::vector<float> buf(ggml_nelements(t));
    ggml_backend_tensor_get(t, buf.data(), 0, ggml_nbytes(t));
    char name[64] = {0};
    strncpy(name, ggml_get_name(t), sizeof(name) - 1);
    fwrite(name, 1, sizeof(name), g_dump);
    fwrite(t->ne, sizeof(int64_t), 4, g_dump);
    fwrite(buf.data(), sizeof(float), buf.size(), g_dump);
    return true;
}

static void read_exact(FILE * f, void * dst, size_t n) {
    if (fread(dst, 1, n, f) != n) die("short read on IN.bin");
}

int main(int argc, char ** argv) {
    if (argc < 4) die("usage: llama-mtp-logits MODEL IN.bin OUT.bin [n_threads]");
    const int n_threads = argc > 4 ? atoi(argv[4]) : 1;

    FILE * in = fopen(argv[2], "rb");
    if (!in) die("cannot open IN.bin");
    int32_t n_steps = 0, n_embd_out = 0;
    read_exact(in, &n_steps, 4);
    read_exact(in, &n_embd_out, 4);

    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.load_mtp = true;
    mp.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) die("model load failed");
    if (llama_model_n_layer_nextn(model) != 1) die("model has no MTP (nextn) block");
    if (llama_model_n_embd_out(model) != n_embd_out) die("IN.bin width != n_embd_out");
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

    llama_context_params cp = llama_context_default_params();
    cp.ctx_type = LLAMA_CONTEXT_TYPE_MTP;
    cp.n_ctx = 256;
    cp.n_batch = cp.n_ubatch = 8;
    cp.n_seq_max = 1;
    cp.n_threads = cp.n_threads_batch = n_threads;
    if (const char * dump = getenv("LLAMA_MTP_DUMP")) {
        g_dump = fopen(dump, "wb");
        if (!g_dump) die("cannot open LLAMA_MTP_DUMP");
        cp.cb_eval = dump_cb;
        cp.cb_eval_user_data = nullptr;
    }
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) die("MTP context creation failed");
    llama_set_embeddings_nextn(ctx, true, /*masked*/ true);

    FILE * out = fopen(argv[3], "wb");
    if (!out) die("cannot open OUT.bin");
    llama_batch b = llama_batch_init(1, n_embd_out, 1);   // allocates embd (the h state) ...
    b.token = (llama_token *) malloc(sizeof(llama_token)); // ... and a token, both read by MTP
    for (int32_t i = 0; i < n_steps; ++i) {
        int32_t tok = 0, pos = 0;
        read_exact(in, &tok, 4);
        read_exact(in, &pos, 4);
        read_exact(in, b.embd, sizeof(float) * (size_t) n_embd_out);
        b.n_tokens = 1;
        b.token[0] = tok;
        b.pos[0] = pos;
        b.n_seq_id[0] = 1;
        b.seq_id[0][0] = 0;
        b.logits[0] = 1;
        if (llama_decode(ctx, b) != 0) die("llama_decode failed");
        const float * logits = llama_get_logits_ith(ctx, 0);
        const float * h_next = llama_get_embeddings_nextn_ith(ctx, 0);
        if (!logits || !h_next) die("no logits / h_nextn output");
        fwrite(logits, sizeof(float), (size_t) n_vocab, out);
        fwrite(h_next, sizeof(float), (size_t) n_embd_out, out);
        g_step0 = false;
    }
    if (g_dump) fclose(g_dump);
    fclose(out);
    fclose(in);
    llama_batch_free(b);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    fprintf(stderr, "llama-mtp-logits: %d steps, n_vocab %d, n_embd_out %d\n",
            n_steps, n_vocab, n_embd_out);
    return 0;
}

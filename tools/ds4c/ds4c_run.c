/* ds4c_run: drive a locally built ds4.c through its public API (ds4.h) and write raw results.
 *
 * Part of ds4ref's tools (not of ds4.c). Used to record extra oracle data and to measure how far
 * ds4.c rebuilt with other compiler flags lands from the golden files (see tools/ds4c/README.md).
 *
 *   ds4c_run MODEL stream IDS STEPS OUT      1-token sync, eval the rest of IDS, then eval STEPS
 *   ds4c_run MODEL batch  IDS STEPS OUT      sync all of IDS, then eval STEPS (teacher forced)
 *                                            (STEPS "greedy:N": N steps of ds4's own argmax, listed in OUT.tokens)
 *   ds4c_run MODEL sample IDS PARAMS OUT     sync IDS, then for each PARAMS row draw tokens
 *   ds4c_run MODEL tokenize TEXTS - OUT      ds4_tokenize_text of each NUL-separated text
 *   ds4c_run MODEL rendered TEXTS - OUT      ds4_tokenize_rendered_chat of each text
 *   ds4c_run MODEL chat TEXTS - OUT          ds4_encode_chat_prompt of each (system, prompt, think) triple
 *   ds4c_run MODEL vocab - - OUT             ds4_token_text of every token id
 *   ds4c_run MODEL bench IDS N OUT           warm up, time sync(IDS), then N greedy evals (text out:
 *                                            prefill_s decode_median_s decode_min_s)
 *
 * IDS / STEPS: int32 little-endian arrays. OUT: float32 logits [rows, n_vocab] (stream, batch),
 * or int32 rows (sample: the draws of each PARAMS row then the uint64 generator state; tokenize,
 * rendered, chat: int32 count then ids per text; vocab: int32 byte count then bytes per token). PARAMS: rows of float32 {temperature, top_k, top_p, min_p,
 * seed_lo, seed_hi, n_draws} (seed halves and counts stored as floats of exact integers).
 * Environment: DS4C_THREADS (default 1); DS4C_WARM set: ds4.c's warm_weights option.
 * Directional steering (any mode): DS4C_STEER_FILE names the f32 [n_layer, n_embd] direction file
 * (ds4_engine_options.directional_steering_file); DS4C_STEER_FFN (default 1, as ds4's CLI when a file is
 * given) and DS4C_STEER_ATTN (default 0) set directional_steering_ffn / _attn.
 */
#define _POSIX_C_SOURCE 199309L  /* clock_gettime under -std=c99 */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "ds4.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void *read_all(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) { perror(path); exit(2); }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    if (fread(buf, 1, (size_t)n, f) != (size_t)n) { perror(path); exit(2); }
    buf[n] = 0;
    fclose(f);
    *len = (size_t)n;
    return buf;
}

static int n_vocab_of(ds4_session *s) {
    /* the public API does not name the vocab size: ask for more scores than any tiny vocab has */
    static ds4_token_score probe[1 << 20];
    return ds4_session_top_logprobs(s, probe, 1 << 20);
}

static void write_logits(ds4_session *s, FILE *out, int n_vocab) {
    ds4_token_score *sc = malloc(sizeof(*sc) * (size_t)n_vocab);
    float *row = malloc(sizeof(float) * (size_t)n_vocab);
    ds4_session_top_logprobs(s, sc, n_vocab);
    for (int i = 0; i < n_vocab; i++) row[sc[i].id] = sc[i].logit;
    fwrite(row, sizeof(float), (size_t)n_vocab, out);
    free(row);
    free(sc);
}

static void check(int rc, const char *what, const char *err) {
    if (rc != 0) { fprintf(stderr, "ds4c_run: %s failed: %s\n", what, err); exit(3); }
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: ds4c_run MODEL stream|batch|sample|tokenize IN1 IN2 OUT\n");
        return 1;
    }
    const char *mode = argv[2];
    ds4_engine_options o;
    memset(&o, 0, sizeof o);
    o.model_path = argv[1];
    o.backend = DS4_BACKEND_CPU;
    o.n_threads = getenv("DS4C_THREADS") ? atoi(getenv("DS4C_THREADS")) : 1;
    o.warm_weights = getenv("DS4C_WARM") != NULL;        /* touch every weight page at open (model_warm_weights) */
    if (getenv("DS4C_STEER_FILE")) {                     /* ds4 --dir-steering-file/-ffn/-attn */
        o.directional_steering_file = getenv("DS4C_STEER_FILE");
        o.directional_steering_ffn = getenv("DS4C_STEER_FFN") ? (float)atof(getenv("DS4C_STEER_FFN")) : 1.0f;
        o.directional_steering_attn = getenv("DS4C_STEER_ATTN") ? (float)atof(getenv("DS4C_STEER_ATTN")) : 0.0f;
    }
    ds4_engine *e;
    if (ds4_engine_open(&e, &o) != 0) { fprintf(stderr, "ds4c_run: cannot open %s\n", argv[1]); return 3; }
    FILE *out = fopen(argv[5], "wb");
    char err[512] = {0};

    if (!strcmp(mode, "vocab")) {
        ds4_session *vs;
        check(ds4_session_create(&vs, e, 64), "session_create", "");
        ds4_tokens bos = {0};
        ds4_tokens_push(&bos, 0);
        check(ds4_session_sync(vs, &bos, err, sizeof err), "sync", err);
        const int n_vocab = n_vocab_of(vs);
        for (int id = 0; id < n_vocab; id++) {
            size_t n = 0;
            char *text = ds4_token_text(e, id, &n);
            int32_t n32 = (int32_t)n;
            fwrite(&n32, 4, 1, out);
            fwrite(text, 1, n, out);
            free(text);
        }
        fclose(out);
        return 0;
    }
    if (!strcmp(mode, "tokenize") || !strcmp(mode, "rendered") || !strcmp(mode, "chat")) {
        size_t len;
        char *texts = read_all(argv[3], &len);
        for (size_t off = 0; off < len; off += strlen(texts + off) + 1) {
            ds4_tokens t = {0};
            if (!strcmp(mode, "tokenize")) {
                ds4_tokenize_text(e, texts + off, &t);
            } else if (!strcmp(mode, "rendered")) {
                ds4_tokenize_rendered_chat(e, texts + off, &t);
            } else {
                const char *system = texts + off;
                const char *prompt = system + strlen(system) + 1;
                const char *think = prompt + strlen(prompt) + 1;
                off = (size_t)(think - texts);
                ds4_think_mode m = !strcmp(think, "high") ? DS4_THINK_HIGH :
                                   !strcmp(think, "max") ? DS4_THINK_MAX : DS4_THINK_NONE;
                ds4_encode_chat_prompt(e, system[0] ? system : NULL, prompt, m, &t);
            }
            int32_t n = t.len;
            fwrite(&n, 4, 1, out);
            fwrite(t.v, 4, (size_t)t.len, out);
            ds4_tokens_free(&t);
        }
        fclose(out);
        return 0;
    }

    size_t len;
    int32_t *ids = read_all(argv[3], &len);
    int n_ids = (int)(len / 4);
    ds4_session *s;
    check(ds4_session_create(&s, e, 1024), "session_create", "");
    ds4_tokens t = {0};

    if (!strcmp(mode, "sample")) {
        for (int i = 0; i < n_ids; i++) ds4_tokens_push(&t, ids[i]);
        check(ds4_session_sync(s, &t, err, sizeof err), "sync", err);
        size_t plen;
        double *p = read_all(argv[4], &plen);
        for (size_t r = 0; r + 7 <= plen / 8; r += 7) {
            uint64_t rng = (uint64_t)(uint32_t)p[r + 4] | ((uint64_t)(uint32_t)p[r + 5] << 32);
            for (int d = 0; d < (int)p[r + 6]; d++) {
                int32_t tok = ds4_session_sample(s, (float)p[r], (int)p[r + 1], (float)p[r + 2], (float)p[r + 3], &rng);
                fwrite(&tok, 4, 1, out);
            }
            fwrite(&rng, 8, 1, out);
        }
        fclose(out);
        return 0;
    }

    if (!strcmp(mode, "bench")) {
        const int n = atoi(argv[4]);
        double *per = malloc(sizeof(double) * (size_t)(n > 0 ? n : 1));
        ds4_session *w;                                   /* warm-up: fault the weights in */
        check(ds4_session_create(&w, e, 1024), "session_create", "");
        for (int i = 0; i < 2 && i < n_ids; i++) ds4_tokens_push(&t, ids[i]);
        check(ds4_session_sync(w, &t, err, sizeof err), "sync", err);
        check(ds4_session_eval(w, ds4_session_argmax(w), err, sizeof err), "eval", err);
        ds4_session_free(w);
        ds4_tokens_free(&t);
        for (int i = 0; i < n_ids; i++) ds4_tokens_push(&t, ids[i]);
        double t0 = now_s();
        check(ds4_session_sync(s, &t, err, sizeof err), "sync", err);
        const double prefill = now_s() - t0;
        for (int i = 0; i < n; i++) {
            const int tok = ds4_session_argmax(s);
            t0 = now_s();
            check(ds4_session_eval(s, tok, err, sizeof err), "eval", err);
            per[i] = now_s() - t0;
        }
        qsort(per, (size_t)n, sizeof(double), cmp_double);
        fprintf(out, "%.9f %.9f %.9f\n", prefill, n > 0 ? per[n / 2] : 0.0, n > 0 ? per[0] : 0.0);
        fclose(out);
        return 0;
    }

    /* STEPS is a file of token ids (teacher forcing), or "greedy:N": N steps each feeding ds4's own argmax;
     * the tokens fed are then written to OUT.tokens (int32) */
    int32_t *steps = NULL;
    int n_steps = 0;
    const bool greedy = !strncmp(argv[4], "greedy:", 7);
    if (greedy) {
        n_steps = atoi(argv[4] + 7);
        steps = calloc((size_t)(n_steps > 0 ? n_steps : 1), sizeof(int32_t));
    } else {
        size_t slen;
        steps = read_all(argv[4], &slen);
        n_steps = (int)(slen / 4);
    }
    int n_vocab = 0;
    if (!strcmp(mode, "stream")) {
        ds4_tokens_push(&t, ids[0]);
        check(ds4_session_sync(s, &t, err, sizeof err), "sync", err);
        n_vocab = n_vocab_of(s);
        write_logits(s, out, n_vocab);
        for (int i = 1; i < n_ids; i++) {
            check(ds4_session_eval(s, ids[i], err, sizeof err), "eval", err);
            write_logits(s, out, n_vocab);
        }
    } else if (!strcmp(mode, "batch")) {
        for (int i = 0; i < n_ids; i++) ds4_tokens_push(&t, ids[i]);
        check(ds4_session_sync(s, &t, err, sizeof err), "sync", err);
        n_vocab = n_vocab_of(s);
        write_logits(s, out, n_vocab);
    } else {
        fprintf(stderr, "ds4c_run: unknown mode %s\n", mode);
        return 1;
    }
    for (int i = 0; i < n_steps; i++) {
        if (greedy) steps[i] = ds4_session_argmax(s);
        check(ds4_session_eval(s, steps[i], err, sizeof err), "eval", err);
        write_logits(s, out, n_vocab);
    }
    fclose(out);
    if (greedy) {
        char path[4096];
        snprintf(path, sizeof path, "%s.tokens", argv[5]);
        FILE *tf = fopen(path, "wb");
        fwrite(steps, sizeof(int32_t), (size_t)n_steps, tf);
        fclose(tf);
    }
    return 0;
}

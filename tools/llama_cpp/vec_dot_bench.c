// Time one weight type's dot product in llama.cpp's ggml CPU backend, one thread:
// every row of a tensor read straight from a GGUF, against one activation row quantized
// by ggml's own from_float. Prints "<best seconds> <rows> <bytes>". Built and run by
// `python -m ds4ref.dev.bench profile --llama-cpp OUTDIR` (appendix E), against the
// static libraries of tools/llama_cpp/build.sh; ds4ref's own code, ggml's public API.
//
//   vec_dot_bench TYPE FILE OFFSET ROWS COLS REPEATS
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include "ggml.h"
#include "ggml-cpu.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

int main(int argc, char **argv) {
    if (argc != 7) {
        fprintf(stderr, "usage: vec_dot_bench TYPE FILE OFFSET ROWS COLS REPEATS\n");
        return 2;
    }
    const int type = atoi(argv[1]);
    const long long offset = atoll(argv[3]);
    const long rows = atol(argv[4]), cols = atol(argv[5]);
    const int repeats = atoi(argv[6]);
    ggml_cpu_init();
    const struct ggml_type_traits_cpu *w_traits = ggml_get_type_traits_cpu(type);
    const struct ggml_type_traits_cpu *x_traits =
        ggml_get_type_traits_cpu(w_traits->vec_dot_type);
    const size_t row_bytes = ggml_row_size(type, cols);
    const int fd = open(argv[2], O_RDONLY);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0 || offset + (long long)(row_bytes * rows) > st.st_size) {
        fprintf(stderr, "vec_dot_bench: cannot read %ld rows at %lld of %s\n", rows, offset,
                argv[2]);
        return 2;
    }
    const uint8_t *file = mmap(NULL, st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    const uint8_t *w = file + offset;
    volatile uint8_t touched = 0;  // every page mapped before the clock starts
    for (size_t i = 0; i < row_bytes * rows; i += 4096) touched ^= w[i];
    float *x = malloc(sizeof(float) * cols), *out = malloc(sizeof(float) * rows);
    srand(1);
    for (long i = 0; i < cols; i++) x[i] = rand() / (float)RAND_MAX - 0.5f;
    void *xq = malloc(ggml_row_size(w_traits->vec_dot_type, cols));
    x_traits->from_float(x, xq, cols);
    double best = 1e30;
    for (int r = 0; r < repeats; r++) {
        const double t = now();
        for (long i = 0; i < rows; i++)
            w_traits->vec_dot(cols, out + i, 0, w + i * row_bytes, 0, xq, 0, 1);
        const double dt = now() - t;
        if (dt < best) best = dt;
    }
    printf("%.9f %ld %zu\n", best, rows, row_bytes * rows);
    return 0;
}

// Norms, RoPE, sink attention and compressor pooling for ds4ref's CuPy backend.
// Written for ds4ref from the formulas in ds4.c (antirez/ds4 @ 8d57664) and ../shared/ds4-map.md §4;
// no code copied.
#include "ds4_common.cuh"

// RMSNorm of each row (one block per row): sum of squares in double as ds4.c does, then
// scale = 1 / sqrtf(float(ss / n) + eps) in float, out = x * scale (* w when w is given).
// Mirrors ds4.c: rms_norm_weight (l. 2781), rms_norm_no_weight (l. 2772), head_rms_norm_inplace (l. 2790).
extern "C" __global__ void rms_norm_rows(
        const float *x, const float *w, float *out, int n, float eps) {
    __shared__ double red[32];
    const float *xr = x + (long long)blockIdx.x * n;
    float *orow = out + (long long)blockIdx.x * n;
    double ss = 0.0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += (double)xr[i] * (double)xr[i];
    ss = block_sum_d(ss, red);
    const float scale = 1.0f / sqrtf((float)(ss / (double)n) + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        orow[i] = w ? xr[i] * scale * w[i] : xr[i] * scale;
}

// RoPE on the last n_rot dims of every head, in place; adjacent pairs (t_2p, t_2p+1).
// One thread per (head, pair). theta_ext = pos * theta_scale^p is built by p float multiplications,
// as ds4.c builds it, so the angles match its rounding. YaRN: theta = theta_int (1-ramp) + theta_ext ramp
// with theta_int = freq_scale * theta_ext and ramp = 1 - clamp((p - lo) / max(1e-3, hi - lo), 0, 1).
// inverse = 1 rotates by -theta (attention outputs). The host passes theta_scale, lo, hi and mscale.
// Mirrors ds4.c: rope_tail_ext_inplace (l. 4766), rope_yarn_ramp (l. 4747), rope_tail_layer_inplace (l. 4830).
extern "C" __global__ void rope_tail(
        float *x, int n_head, int head_dim, int n_rot, int pos,
        float theta_scale, float freq_scale, int use_yarn, float lo, float hi, float mscale, int inverse) {
    const int n_pair = n_rot / 2;
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n_head * n_pair) return;
    const int h = idx / n_pair, p = idx % n_pair;
    float theta_ext = (float)pos;
    for (int i = 0; i < p; i++) theta_ext *= theta_scale;
    const float theta_int = freq_scale * theta_ext;
    float theta = theta_int;
    if (use_yarn) {
        const float y = ((float)p - lo) / fmaxf(0.001f, hi - lo);
        const float ramp = 1.0f - fminf(1.0f, fmaxf(0.0f, y));
        theta = theta_int * (1.0f - ramp) + theta_ext * ramp;
    }
    const float c = cosf(theta) * mscale;
    const float s = (inverse ? -1.0f : 1.0f) * sinf(theta) * mscale;
    float *t = x + (long long)h * head_dim + (head_dim - n_rot) + 2 * p;
    const float x0 = t[0], x1 = t[1];
    t[0] = x0 * c - x1 * s;
    t[1] = x0 * s + x1 * c;
}

// Sink attention of n_head query heads over R cached rows (K = V: one row is key and value).
// One block per head. s_r = (q_h . k_r) * scale, masked rows (allowed[r] == 0) are skipped,
// m = max(sink_h, max_r s_r), o_h = sum_r e^{s_r - m} k_r / (e^{sink_h - m} + sum_r e^{s_r - m}).
// scratch holds [n_head, R] floats: the scores, then the unnormalised weights.
// Mirrors ds4.c: layer_attention_rows_one (l. 4969) and layer_attention_mixed_one (l. 6700).
extern "C" __global__ void sink_attention(
        const float *q, const float *kv, const float *sinks, const u8 *allowed,
        int D, int R, float scale, float *scratch, float *out) {
    __shared__ float red[32];
    DYNAMIC_SHARED(float, qh);                        // [D]
    const int h = blockIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warp = blockDim.x >> 5;
    float *sc = scratch + (long long)h * R;
    for (int i = threadIdx.x; i < D; i += blockDim.x) qh[i] = q[(long long)h * D + i];
    __syncthreads();

    float m = sinks[h];                               // every thread starts from the sink
    for (int r = warp; r < R; r += n_warp) {          // one warp per row: lanes read the row coalesced
        float dot = 0.0f;
        for (int i = lane; i < D; i += 32) dot += qh[i] * kv[(long long)r * D + i];
        dot = warp_sum(dot) * scale;
        const bool ok = !allowed || allowed[r];
        if (lane == 0) sc[r] = ok ? dot : -1.0e30f;
        if (ok) m = fmaxf(m, dot);
    }
    m = block_max(m, red);

    float denom = 0.0f;
    __syncthreads();                                  // scores written by other warps are visible
    for (int r = threadIdx.x; r < R; r += blockDim.x) {
        const bool ok = !allowed || allowed[r];
        const float wgt = ok ? expf(sc[r] - m) : 0.0f;
        sc[r] = wgt;
        denom += wgt;
    }
    denom = block_sum(denom, red) + expf(sinks[h] - m);
    __syncthreads();

    const float inv = 1.0f / denom;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        float acc = 0.0f;
        for (int r = 0; r < R; r++) acc += sc[r] * kv[(long long)r * D + i];
        out[(long long)h * D + i] = acc * inv;
    }
}

// Softmax pooling of a compressor window, one thread per output dim j.
// ratio 4 (two overlapping lanes): rows 0..3 give column j (previous window), rows 4..7 column hd + j
// (current window), one softmax over those 8 scores; ratio 128: one lane, softmax over 128 rows.
// The sums run in ds4.c's order (ratio 4: row r of the previous window, then row r of the current one).
// An all-masked window (max score <= -5e29) pools to 0.
// Mirrors ds4.c: compressor_pool_decode_state (l. 6459).
extern "C" __global__ void compressor_pool(
        const float *state_kv, const float *state_score, int head_dim, int ratio, float *out) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= head_dim) return;
    const int two = ratio == 4;
    const long long width = (two ? 2 : 1) * (long long)head_dim;
    // row r of the previous window (or the only one), and row r of the current window (ratio 4)
    #define PREV(a, r) a[(long long)(r) * width + j]
    #define CUR(a, r)  a[(long long)(ratio + (r)) * width + head_dim + j]
    float m = -1.0e30f;
    for (int r = 0; r < ratio; r++) {
        m = fmaxf(m, PREV(state_score, r));
        if (two) m = fmaxf(m, CUR(state_score, r));
    }
    if (m <= -0.5e30f) { out[j] = 0.0f; return; }
    float denom = 0.0f, sum = 0.0f;
    for (int r = 0; r < ratio; r++) {
        const float wp = expf(PREV(state_score, r) - m);
        if (two) {
            const float wc = expf(CUR(state_score, r) - m);
            denom += wp + wc;
            sum += wp * PREV(state_kv, r);
            sum += wc * CUR(state_kv, r);
        } else {
            denom += wp;
            sum += wp * PREV(state_kv, r);
        }
    }
    #undef PREV
    #undef CUR
    out[j] = denom > 0.0f ? sum / denom : 0.0f;
}

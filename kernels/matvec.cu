// Quantized matvecs of ds4ref's CuPy backend: one warp per output row, grid.y = token or expert slot.
// Written for ds4ref from the formulas in ds4.c (antirez/ds4 @ 8d57664) and ../shared/ds4-map.md §4a;
// no code copied. Float sums run in a different order from ds4.c's left-to-right loops (a warp
// reduction), so results agree to float rounding, while every integer partial sum is exact.
#include "ds4_common.cuh"

#define ROWS_PER_BLOCK 4   // blockDim.x = 128 = 4 warps, one output row each

// Q8_0 weights (34 B: f16 d, int8 q[32]) times a Q8_0 activation (int8 qs[n], float d[n/32]).
// y[t, r] = sum_b f16(d_w[r,b]) * d_x[t,b] * sum_i q_w[r,b,i] * q_x[t,b,i]
// Mirrors ds4.c: dot_q8_0_row (l. 2958) inside matvec_q8_0 (l. 3566).
extern "C" __global__ void matvec_q8_0_q8_0(
        const u8 *w, long long row_bytes, int rows, int nb,
        const i8 *xq, const float *xd, float *y) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5);
    const int t = blockIdx.y;
    if (r >= rows) return;
    const u8 *row = w + (long long)r * row_bytes;
    const i8 *xqt = xq + (long long)t * nb * 32;
    const float *xdt = xd + (long long)t * nb;
    float acc = 0.0f;
    for (int b = lane; b < nb; b += 32) {
        const u8 *blk = row + (long long)b * 34;
        const int *x4 = (const int *)(xqt + (long long)b * 32);   // 32-byte aligned
        int isum = 0;
        for (int k = 0; k < 8; k++) {
            const int w4 = (int)load_u32_a2(blk + 2 + 4 * k);       // 4 weights, packed int8
            isum = __dp4a(w4, x4[k], isum);
        }
        acc += f16_to_f32(load_u16(blk)) * xdt[b] * (float)isum;
    }
    acc = warp_sum(acc);
    if (lane == 0) y[(long long)t * rows + r] = acc;
}

// The same product for T tokens at once (a prefill's GEMM), TOKENS_PER_WARP tokens per warp: a warp
// loads each 34-byte block of its row once and dots it with up to 8 tokens' codes, so the weights are
// read ceil(T / 8) times instead of T times. grid.y = ceil(T / 8). Each token's sum runs in the order
// of matvec_q8_0_q8_0 (lane-strided blocks, then warp_sum), so both kernels give the same floats.
// Mirrors ds4.c: matvec_q8_0_prequant (l. 3402) on a batch of tokens, as a prefill runs it.
#define TOKENS_PER_WARP 8

extern "C" __global__ void matmul_q8_0_q8_0(
        const u8 *w, long long row_bytes, int rows, int nb, int T,
        const i8 *xq, const float *xd, float *y) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5);
    const int t0 = blockIdx.y * TOKENS_PER_WARP;
    if (r >= rows || t0 >= T) return;
    const int nt = T - t0 < TOKENS_PER_WARP ? T - t0 : TOKENS_PER_WARP;   // the same in a warp
    const u8 *row = w + (long long)r * row_bytes;
    float acc[TOKENS_PER_WARP];
    for (int j = 0; j < TOKENS_PER_WARP; j++) acc[j] = 0.0f;
    for (int b = lane; b < nb; b += 32) {
        const u8 *blk = row + (long long)b * 34;
        int w4[8];
        for (int k = 0; k < 8; k++) w4[k] = (int)load_u32_a2(blk + 2 + 4 * k);
        const float dw = f16_to_f32(load_u16(blk));
        for (int j = 0; j < nt; j++) {
            const long long tb = (long long)(t0 + j) * nb + b;          // token t0 + j, block b
            const int *x4 = (const int *)(xq + tb * 32);
            int isum = 0;
            for (int k = 0; k < 8; k++) isum = __dp4a(w4[k], x4[k], isum);
            acc[j] += dw * xd[tb] * (float)isum;
        }
    }
    for (int j = 0; j < nt; j++) {
        const float sum = warp_sum(acc[j]);
        if (lane == 0) y[(long long)(t0 + j) * rows + r] = sum;
    }
}

// F16 weights times a float vector (not quantized): router, HC fn, compressor and indexer projections.
// Mirrors ds4.c: dot_f16_row (l. 2808) inside matvec_f16 (l. 2841).
extern "C" __global__ void matvec_f16_f32(
        const u16 *w, int rows, int n, const float *x, float *y) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5);
    const int t = blockIdx.y;
    if (r >= rows) return;
    const u16 *row = w + (long long)r * n;
    const float *xt = x + (long long)t * n;
    float acc = 0.0f;
    for (int i = lane; i < n; i += 32) acc += f16_to_f32(row[i]) * xt[i];
    acc = warp_sum(acc);
    if (lane == 0) y[(long long)t * rows + r] = acc;
}

// Weight of slot s: the 3-D expert tensor's expert ids[s] (or the one matrix, when ids is null).
__device__ __forceinline__ const u8 *slot_weight(const u8 *w, const int *ids, long long expert_bytes, int s) {
    return w + (ids ? (long long)ids[s] : 0LL) * expert_bytes;
}

// IQ2_XXS gate and up rows (66 B: f16 d, 8 groups of [4 grid indices | u32 signs+scale]) against
// one Q8_K activation (int8 qs[256 per block], float d per block).
// Element 8l+k of group ib: grid[a_l][k] in {8,25,43}, negated where bit k of the sign byte is set;
// the sign byte is the 7-bit index plus an implied 8th bit that makes the count of minus signs even.
// g[s, r] = 1/8 * sum_blocks d_w * d_y * sum_ib (2*scale_ib + 1) * sum signed_grid * q_y
// grid8 is the 256 x 8 table of grid bytes (the IQ2_XXS grid of ggml, carried as data by ds4ref.quant).
// Mirrors ds4.c: ds4_vec_dot_iq2_xxs_pair_q8_K (l. 1978) / matvec_iq2_xxs_experts_mid_prequant (l. 3917).
extern "C" __global__ void matvec_iq2_xxs_pair_q8_K(
        const u8 *wg, const u8 *wu, long long row_bytes, long long expert_bytes, const int *ids,
        int rows, int nb, const u8 *grid8,
        const i8 *yq, const float *yd, int act_shared,
        float *g_out, float *u_out) {
    __shared__ u8 grid[256 * 8];
    for (int i = threadIdx.x; i < 256 * 8; i += blockDim.x) grid[i] = grid8[i];
    __syncthreads();

    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5);
    const int s = blockIdx.y;
    if (r >= rows) return;
    const u8 *rg = slot_weight(wg, ids, expert_bytes, s) + (long long)r * row_bytes;
    const u8 *ru = slot_weight(wu, ids, expert_bytes, s) + (long long)r * row_bytes;
    const int a = act_shared ? 0 : s;
    const i8 *yqs = yq + (long long)a * nb * 256;
    const float *yds = yd + (long long)a * nb;

    float acc_g = 0.0f, acc_u = 0.0f;
    for (int unit = lane; unit < nb * 8; unit += 32) {        // unit = (block, group of 32)
        const int b = unit >> 3, ib = unit & 7;
        const u8 *bg = rg + (long long)b * 66, *bu = ru + (long long)b * 66;
        const i8 *q8 = yqs + (long long)b * 256 + ib * 32;
        const u32 idx_g = load_u32_a2(bg + 2 + 8 * ib), aux_g = load_u32_a2(bg + 6 + 8 * ib);
        const u32 idx_u = load_u32_a2(bu + 2 + 8 * ib), aux_u = load_u32_a2(bu + 6 + 8 * ib);
        int sum_g = 0, sum_u = 0;
        for (int l = 0; l < 4; l++) {
            const u8 *gg = grid + ((idx_g >> (8 * l)) & 255) * 8;
            const u8 *gu = grid + ((idx_u >> (8 * l)) & 255) * 8;
            u32 sg = (aux_g >> (7 * l)) & 127, su = (aux_u >> (7 * l)) & 127;
            sg |= (__popc(sg) & 1) << 7;
            su |= (__popc(su) & 1) << 7;
            for (int k = 0; k < 8; k++) {
                const int q = q8[8 * l + k];
                sum_g += ((sg >> k) & 1 ? -(int)gg[k] : (int)gg[k]) * q;
                sum_u += ((su >> k) & 1 ? -(int)gu[k] : (int)gu[k]) * q;
            }
        }
        const float dy = yds[b];
        acc_g += f16_to_f32(load_u16(bg)) * dy * (float)(sum_g * (int)(2 * (aux_g >> 28) + 1));
        acc_u += f16_to_f32(load_u16(bu)) * dy * (float)(sum_u * (int)(2 * (aux_u >> 28) + 1));
    }
    acc_g = warp_sum(acc_g);
    acc_u = warp_sum(acc_u);
    if (lane == 0) {
        g_out[(long long)s * rows + r] = 0.125f * acc_g;
        u_out[(long long)s * rows + r] = 0.125f * acc_u;
    }
}

// Q2_K rows (84 B: scales[16] (low nibble scale, high nibble min), qs[64], f16 d, f16 dmin) against
// Q8_K activations (int8 qs, float d, int16 bsums[16 per block]).
// Element e of a block: q = (qs[32*(e/128) + e%32] >> 2*((e%128)/32)) & 3, group g = e/16;
// y = sum_blocks d_y * (d_w * sum_g sc_g * sum_{e in g} q_e q_y,e  -  dmin_w * sum_g m_g * bsums_g)
// Mirrors ds4.c: ds4_vec_dot_q2_K_q8_K (l. 1769) / matvec_q2_k_experts_accum_prequant (l. 4034).
extern "C" __global__ void matvec_q2_K_q8_K(
        const u8 *w, long long row_bytes, long long expert_bytes, const int *ids,
        int rows, int nb,
        const i8 *yq, const float *yd, const short *ybsums, int act_shared,
        float *y) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5);
    const int s = blockIdx.y;
    if (r >= rows) return;
    const u8 *row = slot_weight(w, ids, expert_bytes, s) + (long long)r * row_bytes;
    const int a = act_shared ? 0 : s;
    const i8 *yqs = yq + (long long)a * nb * 256;
    const float *yds = yd + (long long)a * nb;
    const short *ybs = ybsums + (long long)a * nb * 16;

    float acc = 0.0f;
    for (int unit = lane; unit < nb * 16; unit += 32) {       // unit = (block, group of 16)
        const int b = unit >> 4, grp = unit & 15;
        const u8 *blk = row + (long long)b * 84;
        const u8 sc = blk[grp];
        const int e0 = grp * 16;
        const int half = e0 >> 7, shift = 2 * ((e0 & 127) >> 5), l0 = e0 & 31;
        const u8 *qs = blk + 16 + 32 * half + l0;
        const i8 *q8 = yqs + (long long)b * 256 + e0;
        int isum = 0;
        for (int i = 0; i < 16; i++) isum += (int)((qs[i] >> shift) & 3) * (int)q8[i];
        const float dy = yds[b];
        acc += dy * f16_to_f32(load_u16(blk + 80)) * (float)((sc & 15) * isum)
             - dy * f16_to_f32(load_u16(blk + 82)) * (float)((sc >> 4) * (int)ybs[b * 16 + grp]);
    }
    acc = warp_sum(acc);
    if (lane == 0) y[(long long)s * rows + r] = acc;
}

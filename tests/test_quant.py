"""Chapter 02 (quantization formats): ds4ref.quant against ds4.c's recorded data and the gguf package."""
from __future__ import annotations

import re

import gguf
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra.numpy import arrays

import ds4ref.dev.quantize as WQ  # the weight quantizers (appendix C)
import ds4ref.kvquant as KQ  # the cache formats (chapter 2)
import ds4ref.quant as Q
from ds4ref.quant import QuantError

N_RANDOM_BLOCKS = 10_000
Q8_SOURCE = {  # q8.<name> -> the op output that ds4.c quantized (data/oracle/README.md)
    "attn_q_a": "attn_norm", "attn_kv": "attn_norm", "attn_q_b": "qr_norm", "attn_output_a": "heads_unrope",
    "attn_output_b": "attn_low", "ffn_gate_shexp": "ffn_norm", "ffn_down_shexp": "shared_mid", "output": "out_norm",
}
Q8K_SOURCE = {"ffn_gate_up_exps": "ffn_norm", "ffn_down_exps": "exp_mid"}


def bits(a) -> np.ndarray:
    """float32 bit patterns, so that equality is bit for bit (sign of zero and NaN payloads included)."""
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def random_blocks(ggml_type: int, n: int, seed: int) -> np.ndarray:
    """n random blocks of a type as uint8 [n, block_bytes]: random bytes, then finite random F16 scales."""
    rng = np.random.default_rng(seed)
    elems, nbytes, dt = Q.BLOCKS[ggml_type]
    raw = rng.integers(0, 256, (n, nbytes), dtype=np.uint8)
    blocks = raw.view(dt)[:, 0]
    for f in dt.names or ():
        if dt[f] == np.dtype("<f2"):
            blocks[f] = (rng.standard_normal(blocks[f].shape) * rng.choice([1e-4, 1e-2, 1, 100], blocks[f].shape)).astype(np.float16)
    return raw


# ---------------------------------------------------------------- formats and tables

def test_block_dtypes_have_ds4c_struct_sizes():
    assert [Q.BLOCKS[t][2].itemsize for t in (Q.Q8_0, Q.Q2_K, Q.Q4_K, Q.Q8_K, Q.IQ2_XXS)] == [34, 84, 144, 292, 66]
    assert {t: Q.BLOCKS[t][1] for t in Q.BLOCKS} == {t: gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t)][1] for t in Q.BLOCKS}
    assert {t: Q.BLOCKS[t][0] for t in Q.BLOCKS} == {t: gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t)][0] for t in Q.BLOCKS}


def test_iq2xxs_tables_equal_gguf_package_and_have_documented_structure():
    ref = gguf.quants.IQ2_XXS
    ref.init_grid()
    assert np.array_equal(ref.grid.reshape(256, 8), Q.iq2xxs_grid.astype(np.float32))
    assert np.array_equal(np.frombuffer(ref.ksigns, np.uint8), Q.ksigns_iq2xs)
    assert set(np.unique(Q.iq2xxs_grid)) == {8, 25, 43}
    assert len({tuple(r) for r in Q.iq2xxs_grid}) == 256
    # every sign pattern has an even number of minus signs, and bits 0-6 are the index itself
    assert (np.unpackbits(Q.ksigns_iq2xs).reshape(128, 8).sum(1) % 2 == 0).all()
    assert np.array_equal(Q.ksigns_iq2xs & 127, np.arange(128))
    assert np.array_equal(Q.kmask_iq2xs, [1, 2, 4, 8, 16, 32, 64, 128])
    assert ((Q.iq2xxs_signs == -1).sum(1) % 2 == 0).all()


def test_e4m3_and_e2m1_tables():
    v = KQ.E4M3_VALUES
    assert v.size == 127 and v[-1] == 448 and v[1] == 2.0**-9 and (np.diff(v) > 0).all()
    # the notes' example (ds4-map.md §5 row 27): 0_1000_011 is 2.75, and 3.14159 rounds to 3.25
    assert v[0b1000011] == 2.75 and KQ.e4m3fn_round(np.float32(3.14159)) == 3.25
    assert np.array_equal(KQ.e2m1_round(np.float32([0.25, 0.75, 1.25, 2.5, 3.5, 5, 7, -0.25])),
                          np.float32([0, 1, 1, 2, 4, 4, 6, -0.0]))


# ---------------------------------------------------------------- dequantize vs the gguf package

@pytest.mark.parametrize("name", ["Q8_0", "Q2_K", "Q4_K", "IQ2_XXS", "F16", "BF16", "F32"])
def test_dequantize_equals_gguf_package_bit_for_bit_on_random_blocks(name):
    t = getattr(Q, name)
    elems, nbytes, _ = Q.BLOCKS[t]
    per_row = max(1, 256 // elems)                              # several blocks per row
    raw = random_blocks(t, N_RANDOM_BLOCKS * per_row if elems == 1 else N_RANDOM_BLOCKS, seed=t)
    raw = raw.reshape(-1, per_row * nbytes)
    ours = Q.dequantize(raw, t)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(t))
    assert ours.dtype == np.float32 and ours.shape == (raw.shape[0], per_row * elems)
    if name == "BF16":  # the gguf package returns BF16 as float32 with the same bits
        ref = np.asarray(ref, np.float32)
    assert np.array_equal(bits(ours), bits(ref.reshape(ours.shape)))


def test_q8_K_dequantize_is_d_times_qs_from_the_raw_bytes():
    raw = np.random.default_rng(5).integers(0, 256, (200, 292), dtype=np.uint8)
    raw[:, 0:4] = np.random.default_rng(6).standard_normal((200, 1)).astype("<f4").view(np.uint8)
    d = raw[:, 0:4].copy().view("<f4")
    qs = raw[:, 4:260].view(np.int8).astype(np.float32)
    assert np.array_equal(bits(Q.dequantize(raw, Q.Q8_K)), bits(qs * d))


def test_dequantize_equals_gguf_package_on_every_oracle_tensor(oracle_gguf):
    reader = gguf.GGUFReader(oracle_gguf)
    seen = set()
    for t in reader.tensors:
        raw = np.asarray(t.data).view(np.uint8)
        if int(t.tensor_type) == gguf.GGMLQuantizationType.I32:
            with pytest.raises(QuantError, match="unsupported ggml type"):
                Q.dequantize(raw.reshape(-1, 4 * int(t.shape[0])), int(t.tensor_type))
            continue
        rows = raw.reshape(-1, Q.row_bytes(int(t.shape[0]), int(t.tensor_type)))
        ours = Q.dequantize(rows, int(t.tensor_type))
        ref = gguf.quants.dequantize(rows, t.tensor_type)
        assert np.array_equal(bits(ours), bits(np.asarray(ref).reshape(ours.shape))), t.name
        seen.add(t.tensor_type.name)
    assert seen == {"F32", "F16", "Q8_0", "Q2_K", "IQ2_XXS"}


def test_unpack_helpers_rebuild_dequantize():
    raw = random_blocks(Q.Q2_K, 50, 1).reshape(10, -1)
    sc, m, q, d, dmin = Q.unpack_q2_K(raw)
    w = (d[..., None, None] * sc[..., None]) * q.reshape(10, 5, 16, 16) - (dmin[..., None, None] * m[..., None])
    assert np.array_equal(w.reshape(10, -1), Q.dequantize(raw, Q.Q2_K))
    raw = random_blocks(Q.IQ2_XXS, 50, 2).reshape(10, -1)
    d, grid, signs, scales = Q.unpack_iq2_xxs(raw)
    w = d[..., None] * np.repeat(2 * scales + 1, 32, axis=-1) / 8 * signs * grid
    assert np.array_equal(w.reshape(10, -1).astype(np.float32), Q.dequantize(raw, Q.IQ2_XXS))


# ---------------------------------------------------------------- activation quantizers vs ds4.c

def test_quantize_q8_0_is_bit_exact_on_every_ds4c_dump(ops_A):
    n_keys = n_blocks = 0
    for key in ops_A.files:
        m = re.fullmatch(r"(.*)q8\.(\w+)\.qs", key)
        if not m:
            continue
        pre, name = m.groups()
        a = Q.quantize_q8_0(ops_A[pre + Q8_SOURCE[name]].reshape(-1))
        assert np.array_equal(a.qs, ops_A[key].reshape(-1)), key
        assert np.array_equal(bits(a.d), bits(ops_A[f"{pre}q8.{name}.d"].reshape(-1))), key
        n_keys += 1
        n_blocks += a.d.size
    assert n_keys == 731 and n_blocks == 10948


def test_quantize_q8_K_is_bit_exact_on_every_ds4c_dump(ops_A):
    n_keys = 0
    for key in ops_A.files:
        m = re.fullmatch(r"(.*)q8k\.(\w+)\.qs", key)
        if not m:
            continue
        pre, name = m.groups()
        a = Q.quantize_q8_K(ops_A[pre + Q8K_SOURCE[name]])          # [256] or [6, 256]: batch dims kept
        assert np.array_equal(a.qs, ops_A[key].reshape(a.qs.shape)), key
        assert np.array_equal(bits(a.d), bits(ops_A[f"{pre}q8k.{name}.d"].reshape(a.d.shape))), key
        assert np.array_equal(a.bsums, ops_A[f"{pre}q8k.{name}.bsums"].reshape(a.bsums.shape)), key
        n_keys += 1
    assert n_keys == 204


def test_q8_K_scale_is_negative_for_a_positive_maximum_and_zero_blocks_are_zero():
    x = np.zeros(512, np.float32)
    x[3], x[7] = 2.0, -2.0                          # ties in |x|: the first one wins
    a = Q.quantize_q8_K(x)
    assert a.d[0] == np.float32(2.0) * np.float32(-1 / 127) and a.qs[3] == -127 and a.qs[7] == 127
    assert bits(a.d[1]) == 0 and not a.qs[256:].any() and not a.bsums[16:].any()
    assert a.bsums.dtype == np.int16 and a.bsums[0] == 0


def test_activation_blocks_below_127_over_float_max_still_get_full_scale_codes():
    """127/amax overflows float32 for amax < 3.7e-37 (ds4.c's lrintf(inf) is undefined there): codes stay exact."""
    x = np.zeros(256, np.float32)
    x[:4] = [1e-38, -5e-39, 2.5e-39, 0]
    a = Q.quantize_q8_0(x)
    assert a.qs[:4].tolist() == [127, -64, 32, 0] and a.d[0] == np.float32(1e-38) * np.float32(1 / 127)
    k = Q.quantize_q8_K(x)
    assert k.qs[:4].tolist() == [-127, 64, -32, 0] and k.bsums[0] == -95 and k.d[0] < 0


def test_quantize_q8_0_pads_a_short_last_block_with_zeros():
    x = np.linspace(-1, 1, 40, dtype=np.float32)
    a = Q.quantize_q8_0(x)
    assert a.qs.shape == (64,) and a.d.shape == (2,) and not a.qs[40:].any()
    assert np.array_equal(Q.quantize_q8_0(np.zeros(32, np.float32)).d, [0])


def test_kv_fp8_f16_and_indexer_fp4_are_bit_exact_on_ds4c_rows(ops_A):
    counts = {}
    for key in ops_A.files:
        pre, _, name = key.rpartition(".")
        if name in ("kv_rope", "comp_rope"):
            out = "kv_fp8" if name == "kv_rope" else "comp_row"
            stored = "kv_stored" if name == "kv_rope" else "comp_stored"
            assert np.array_equal(bits(KQ.fp8_kv_quantize_row(ops_A[key], 64)), bits(ops_A[f"{pre}.{out}"])), key
        elif name in ("icomp_rope", "idx_q_rope"):
            out, stored = ("icomp_row", "icomp_stored") if name == "icomp_rope" else ("idx_q", None)
            assert np.array_equal(bits(KQ.indexer_qat_row(ops_A[key])), bits(ops_A[f"{pre}.{out}"])), key
        else:
            continue
        if stored:
            assert np.array_equal(bits(Q.f16_round(ops_A[f"{pre}.{out}"])), bits(ops_A[f"{pre}.{stored}"])), key
        counts[name] = counts.get(name, 0) + 1
    assert counts == {"kv_rope": 102, "comp_rope": 20, "icomp_rope": 16, "idx_q_rope": 16}


def test_hadamard128_is_the_natural_order_sylvester_matrix_and_orthonormal():
    sylvester = np.ones((1, 1))
    while sylvester.shape[0] < 128:                                # H_2n = [[H, H], [H, -H]]
        sylvester = np.block([[sylvester, sylvester], [sylvester, -sylvester]])
    h = KQ.hadamard128(np.eye(128, dtype=np.float32))               # row i = transform of e_i
    assert np.array_equal(np.sign(h), sylvester)
    assert np.allclose(h, sylvester / np.sqrt(128), rtol=1e-6, atol=0)
    x = np.random.default_rng(0).standard_normal((5, 128)).astype(np.float32)
    assert np.allclose(KQ.hadamard128(KQ.hadamard128(x)), x, atol=1e-5)
    assert np.allclose(h @ h.T, np.eye(128), atol=1e-6)


# ---------------------------------------------------------------- weight quantizers and their bounds

def gaussian(rows, n, seed=0):
    x = np.random.default_rng(seed).standard_normal((rows, n)).astype(np.float32)
    x[0, :256] = 0                                              # an all-zero block
    x[1, :256] *= 1e-3                                          # a tiny block
    x[2, :256] = np.abs(x[2, :256]) + 1                         # an all-positive block (no min term needed)
    x[3, :256] = -np.abs(x[3, :256])                            # an all-negative block
    return x


def test_quantize_q8_0_equals_gguf_package():
    x = gaussian(64, 512, seed=1)
    x[5, :32] = np.float32(0.5) * np.arange(32) - 8               # exact .5 ties after scaling
    assert np.array_equal(WQ.quantize(x, Q.Q8_0), gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0))


def test_q8_0_round_trip_within_half_step_plus_scale_rounding():
    x = gaussian(64, 512, seed=2)
    err = np.abs(Q.dequantize(WQ.quantize(x, Q.Q8_0), Q.Q8_0) - x).reshape(-1, 32)
    amax = np.abs(x).reshape(-1, 32).max(1, keepdims=True)
    # |x - q f16(d)| <= d/2 + 127 |d - f16(d)|, and F16 rounds d by at most 2^-11 d (normal) or 2^-25 (subnormal)
    d = amax / 127
    assert (err <= (d / 2 + 127 * np.maximum(d * 2.0**-11, 2.0**-25)) * (1 + 1e-6)).all()


@pytest.mark.parametrize("name,group,levels,n_scale", [("Q2_K", 16, 4, 16), ("Q4_K", 32, 16, 64)])
def test_k_quant_group_rms_within_half_the_covering_step(name, group, levels, n_scale):
    t = getattr(Q, name)
    x = gaussian(32, 1024, seed=3)
    err = (Q.dequantize(WQ.quantize(x, t), t) - x).reshape(-1, 256 // group, group)
    xg = x.reshape(err.shape)
    lo, hi = np.minimum(xg.min(-1), 0), xg.max(-1)
    slack = 1 + 2.0**-9                                           # F16 rounding up of d and dmin, float32 ops
    dmin = (-lo).max(-1, keepdims=True) / (n_scale - 1) * slack
    step_need = (hi - lo + dmin) / (levels - 1)
    d = step_need.max(-1, keepdims=True) / (n_scale - 1) * slack
    bound = (step_need + d) / 2                                   # half of the covering fit's step
    rms = np.sqrt((err ** 2).mean(-1))
    assert (rms <= bound * slack + 1e-30).all()
    assert not err[0].any()                                       # zero block stays zero
    ratio = np.sqrt((err[4:] ** 2).mean() / (xg[4:] ** 2).mean())
    assert ratio < {"Q2_K": 0.30, "Q4_K": 0.085}[name]           # measured 0.28 and 0.080 on N(0, 1)


def test_iq2_xxs_points_are_optimal_given_the_scales():
    """Brute force over all 256 x 128 signed grid points: the quantizer's choice has the least error."""
    x = np.random.default_rng(9).standard_normal((2, 256)).astype(np.float32)
    x[1] *= np.linspace(0.01, 3, 256, dtype=np.float32)            # groups of very different sizes
    raw = WQ.quantize(x, Q.IQ2_XXS)
    d, _, _, scales = Q.unpack_iq2_xxs_indices(raw)
    y = Q.dequantize(raw, Q.IQ2_XXS)
    signed = (Q.iq2xxs_grid[:, None, :].astype(np.float32) * Q.iq2xxs_signs[None, :, :]).reshape(-1, 8)
    dg = (d[..., None] * (2 * scales.astype(np.float32) + 1) / 8).reshape(-1)      # per 32-group
    xv, yv = x.reshape(-1, 8), y.reshape(-1, 8)
    for v in range(xv.shape[0]):
        cand = ((dg[v // 4] * signed - xv[v]) ** 2).sum(-1)
        assert ((yv[v] - xv[v]) ** 2).sum() <= cand.min() * (1 + 1e-5) + 1e-12


def test_iq2_xxs_round_trip_error_on_gaussian_weights():
    x = np.random.default_rng(7).standard_normal((8, 1024)).astype(np.float32)
    err = Q.dequantize(WQ.quantize(x, Q.IQ2_XXS), Q.IQ2_XXS) - x
    ratio = np.sqrt((err ** 2).mean() / (x ** 2).mean())
    # above the Gaussian rate-distortion limit 2^-2.0625 = 0.239; measured 0.327
    assert 0.239 < ratio < 0.335


def test_iq2_xxs_d_factors_are_the_super_block_scale_candidates():
    """With one candidate f, every block's d is f16(amax * f32(f / (43 * 31/8))): the
    scale that puts the largest weight on the largest grid value at S = 15, times f.
    Without d_factors the module's IQ2_XXS_D_FACTORS are used, and the module is left
    as it was."""
    x = np.random.default_rng(10).standard_normal((4, 512)).astype(np.float32)
    amax = np.abs(x.reshape(-1, 256)).max(-1)
    for f in (1.0, 0.7):
        d, _, _, _ = Q.unpack_iq2_xxs_indices(WQ.quantize(x, Q.IQ2_XXS, d_factors=[f]))
        want = (amax * np.float32(f / (43 * 31 / 8))).astype(np.float16)
        assert np.array_equal(np.asarray(d).reshape(-1), want.astype(np.float32))
    before = WQ.IQ2_XXS_D_FACTORS
    default = WQ.quantize(x, Q.IQ2_XXS)
    assert np.array_equal(default, WQ.quantize(x, Q.IQ2_XXS, d_factors=before))
    WQ.quantize(x, Q.IQ2_XXS, d_factors=np.linspace(0.4, 1.2, 41))
    assert WQ.IQ2_XXS_D_FACTORS == before
    assert np.array_equal(default, WQ.quantize(x, Q.IQ2_XXS))


@pytest.mark.parametrize("call,match", [
    (lambda: WQ.quantize(np.ones((1, 256), np.float32), Q.IQ2_XXS, d_factors=[]),
     "d_factors must be one or more finite positive"),
    (lambda: WQ.quantize(np.ones((1, 256), np.float32), Q.IQ2_XXS, d_factors=[1, 0]),
     "d_factors must be one or more finite positive"),
    (lambda: WQ.quantize(np.ones((1, 256), np.float32), Q.IQ2_XXS, d_factors=[np.nan]),
     "d_factors must be one or more finite positive"),
    (lambda: WQ.quantize(np.ones((1, 256), np.float32), Q.IQ2_XXS, d_factors="big"),
     "d_factors must be one or more finite positive"),
    (lambda: WQ.quantize(np.ones((1, 256), np.float32), Q.Q2_K, d_factors=[1.0]),
     "d_factors is only used by IQ2_XXS"),
])
def test_bad_d_factors_raise_quant_error(call, match):
    with pytest.raises(QuantError, match=match):
        call()


def test_iq2_xxs_imatrix_trades_error_towards_important_columns():
    x = np.random.default_rng(8).standard_normal((8, 512)).astype(np.float32)
    w = np.ones(512, np.float32)
    w[::8] = 100
    plain = (Q.dequantize(WQ.quantize(x, Q.IQ2_XXS), Q.IQ2_XXS) - x) ** 2
    weighted = (Q.dequantize(WQ.quantize(x, Q.IQ2_XXS, imatrix=w), Q.IQ2_XXS) - x) ** 2
    assert weighted[:, ::8].mean() < 0.7 * plain[:, ::8].mean()


def test_f16_and_bf16_weights_round_to_nearest_even():
    x = gaussian(4, 256, seed=5)
    assert np.array_equal(Q.dequantize(WQ.quantize(x, Q.F16), Q.F16), Q.f16_round(x))
    ref = gguf.quants.quantize(x, gguf.GGMLQuantizationType.BF16)
    assert np.array_equal(WQ.quantize(x, Q.BF16), np.asarray(ref).view(np.uint8).reshape(4, -1))


# ---------------------------------------------------------------- bad input

def test_quant_error_is_a_value_error():
    assert issubclass(QuantError, ValueError)


@pytest.mark.parametrize("call,match", [
    (lambda: Q.dequantize(np.zeros((2, 33), np.uint8), Q.Q8_0), "33 bytes is not a multiple of the 34-byte block"),
    (lambda: Q.dequantize(np.zeros((2, 34), np.float32), Q.Q8_0), "must be uint8"),
    (lambda: Q.dequantize(np.zeros((2, 34), np.uint8), 7), "unknown or unsupported ggml type id 7"),
    (lambda: Q.dequantize(np.zeros((2, 34), np.uint8), "Q8_0"), "unknown or unsupported ggml type id 'Q8_0'"),
    (lambda: WQ.quantize(np.zeros((2, 100), np.float32), Q.Q2_K), "row length 100 is not a multiple of the Q2_K block"),
    (lambda: WQ.quantize(np.zeros((2, 256), np.float32), Q.Q8_K), "activation format"),
    (lambda: WQ.quantize(np.zeros((2, 256), np.float32), 99), "unknown or unsupported ggml type id 99"),
    (lambda: Q.quantize_q8_K(np.zeros(100, np.float32)), "length 100 is not a multiple of 256"),
    (lambda: KQ.fp8_kv_quantize_row(np.zeros(100, np.float32), 64), "multiple of 64"),
    (lambda: KQ.indexer_qat_row(np.zeros(64, np.float32)), "128 wide"),
    (lambda: Q.quantize_q8_0(np.float32(1)), "scalar"),
    (lambda: WQ.quantize(np.full((1, 32), 1e7, np.float32), Q.Q8_0), "block scale would overflow F16"),
    (lambda: WQ.quantize(np.full((1, 256), 1.1e7, np.float32), Q.IQ2_XXS), "block scale would overflow F16"),
    (lambda: WQ.quantize(np.full((1, 8), 1e5, np.float32), Q.F16), "beyond the F16 range"),
])
def test_bad_shapes_and_types_raise_quant_error(call, match):
    with pytest.raises(QuantError, match=match):
        call()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("fn", [Q.quantize_q8_0, Q.quantize_q8_K, lambda x: WQ.quantize(x, Q.IQ2_XXS),
                                lambda x: WQ.quantize(x, Q.Q8_0), lambda x: KQ.fp8_kv_quantize_row(x, 64),
                                lambda x: KQ.fp4_act_quantize(x)])
def test_non_finite_input_to_a_quantizer_raises(fn, bad):
    x = np.ones(256, np.float32)
    x[17] = bad
    with pytest.raises(QuantError, match="NaN/inf value.*index 17"):
        fn(x)


# ---------------------------------------------------------------- roundings against independent formulas

def f16_round_float64_reference(x: np.ndarray) -> np.ndarray:
    """IEEE F16 round-to-nearest-even computed in float64 arithmetic: ulp from the exponent, rint, overflow."""
    ax = np.abs(x.astype(np.float64))
    _, e = np.frexp(ax)                                           # ax = f * 2**e, f in [0.5, 1)
    ulp = np.ldexp(1.0, np.maximum(e - 1, -14) - 10)             # F16: 10 mantissa bits, min exponent -14
    v = np.rint(ax / ulp) * ulp                                   # exact: ulp is a power of two
    v = np.where(v > 65504, np.inf, v)
    return np.copysign(v, x).astype(np.float32)


def test_f16_round_equals_ieee_round_to_nearest_even():
    rng = np.random.default_rng(11)
    x = (rng.standard_normal(200_000) * np.exp2(rng.uniform(-30, 17, 200_000))).astype(np.float32)
    x[:4] = [65519.996, 65520.0, 2.0**-25, 2.0**-25 * 1.0000001]  # overflow and underflow edges
    assert np.array_equal(bits(Q.f16_round(x)), bits(f16_round_float64_reference(x)))


def test_e4m3_and_e2m1_round_to_nearest_with_ties_to_even_code():
    rng = np.random.default_rng(12)
    for table, fn, top in ((KQ.E4M3_VALUES, KQ.e4m3fn_round, 448), (KQ.E2M1_VALUES, KQ.e2m1_round, 6)):
        mids = (table[1:].astype(np.float64) + table[:-1]) / 2
        x = np.concatenate([rng.uniform(-1.2 * top, 1.2 * top, 50_000), mids, -mids,
                            rng.uniform(0, table[3], 1000)]).astype(np.float32)
        dist = np.abs(np.minimum(np.abs(x.astype(np.float64)), top)[:, None] - table[None, :].astype(np.float64))
        best = dist.min(1, keepdims=True)
        cand = dist == best                                       # one or two nearest codes
        code = np.where(cand.sum(1) == 2, np.argmax(cand & (np.arange(table.size) % 2 == 0), 1), cand.argmax(1))
        want = np.where(x < 0, -table[code], table[code])
        assert np.array_equal(fn(x), want)


def test_largest_allowed_weights_keep_finite_scales():
    for t, top in ((Q.Q8_0, 65504 * 127), (Q.Q2_K, 65504 * 15), (Q.Q4_K, 65504 * 63), (Q.IQ2_XXS, 65504 * 43 * 31 / 8)):
        x = np.random.default_rng(t).uniform(-1, 1, (2, 256)).astype(np.float32)
        x[:, 7] = np.float32(top) * np.float32(1 - 2.0**-20)
        x[:, 9] = -x[:, 7]
        w = Q.dequantize(WQ.quantize(x, t), t)
        assert np.isfinite(w).all() and np.abs(w).max() <= top * 1.01, Q.TYPE_NAMES[t]
        assert (np.sign(w[:, 7]) == 1).all() and (np.sign(w[:, 9]) == -1).all(), Q.TYPE_NAMES[t]


def test_empty_and_one_dimensional_inputs():
    assert Q.quantize_q8_0(np.zeros((3, 0), np.float32)).qs.shape == (3, 0)
    assert Q.quantize_q8_K(np.zeros((0,), np.float32)).d.shape == (0,)
    assert Q.dequantize(np.zeros((0, 84), np.uint8), Q.Q2_K).shape == (0, 256)
    x = np.random.default_rng(0).standard_normal(256).astype(np.float32)
    raw = WQ.quantize(x, Q.Q4_K)
    assert raw.shape == (144,) and Q.dequantize(raw, Q.Q4_K).shape == (256,)
    with pytest.raises(QuantError, match="imatrix is only used by IQ2_XXS"):
        WQ.quantize(x, Q.Q2_K, imatrix=np.ones(256))
    with pytest.raises(QuantError, match="imatrix must be 256"):
        WQ.quantize(x, Q.IQ2_XXS, imatrix=np.ones(255))


def test_iq2_xxs_index_fields_expand_to_grid_and_signs():
    raw = random_blocks(Q.IQ2_XXS, 20, 3).reshape(4, -1)
    d, gi, si, sc = Q.unpack_iq2_xxs_indices(raw)
    d2, grid, signs, sc2 = Q.unpack_iq2_xxs(raw)
    assert np.array_equal(d, d2) and np.array_equal(sc, sc2) and gi.shape == (4, 5, 32)
    assert np.array_equal(grid.reshape(4, 5, 32, 8), Q.iq2xxs_grid[gi])
    assert np.array_equal(signs.reshape(4, 5, 32, 8), Q.iq2xxs_signs[si])



def test_iq2_xxs_signed_grid_lookup_equals_grid_times_signs():
    """iq2xxs_signed_grid[a, s, k] = -grid[a, k] if bit k of ksigns[s] else grid[a, k] (ds4.c l. 307), and
    unpack_iq2_xxs_signed's one lookup per 8 weights equals a byte-by-byte decode of the block."""
    T = Q.iq2xxs_signed_grid
    assert T.shape == (256, 128, 8) and T.dtype == np.int8
    for a, s in [(0, 0), (7, 1), (255, 127), (100, 64), (31, 99)]:
        want = [(-1 if (Q.ksigns_iq2xs[s] >> k) & 1 else 1) * int(Q.iq2xxs_grid[a, k]) for k in range(8)]
        assert T[a, s].tolist() == want
    raw = random_blocks(Q.IQ2_XXS, 12, 5).reshape(3, -1)
    d, vals, sc = Q.unpack_iq2_xxs_signed(raw)
    d2, grid, signs, sc2 = Q.unpack_iq2_xxs(raw)
    assert vals.shape == (3, 4, 256) and vals.dtype == np.int8
    assert np.array_equal(vals, grid.astype(np.int16) * signs) and np.array_equal(d, d2) and np.array_equal(sc, sc2)
    blk = raw[1, 66:132]                                   # block 1 of row 1, decoded byte by byte
    for grp in range(8):
        w0 = int.from_bytes(bytes(blk[2 + 8 * grp:6 + 8 * grp]), "little")
        w1 = int.from_bytes(bytes(blk[6 + 8 * grp:10 + 8 * grp]), "little")
        assert sc[1, 1, grp] == w1 >> 28
        for l in range(4):
            a, s = (w0 >> 8 * l) & 255, (w1 >> 7 * l) & 127
            assert vals[1, 1, 32 * grp + 8 * l:32 * grp + 8 * l + 8].tolist() == T[a, s].tolist()
    assert Q.unpack_iq2_xxs_signed(np.zeros((2, 0), np.uint8))[1].shape == (2, 0, 256)

finite_f32 = st.floats(min_value=-2.0**100, max_value=2.0**100, allow_nan=False, width=32)


@settings(max_examples=60, deadline=None)
@given(arrays(np.float32, st.tuples(st.integers(1, 3), st.sampled_from([256, 512])), elements=finite_f32))
def test_activation_quantizers_round_trip_within_half_a_step(x):
    a = Q.quantize_q8_0(x)
    step = np.repeat(a.d, 32, axis=-1)
    # |x - d q| <= d/2, up to the float32 roundings of d and of x * 127/amax (a few ulps of amax); a subnormal d
    # is rounded to a multiple of 2^-149, which q = 127 multiplies: 127 * 2^-150 absolute
    tiny = 127 * 2.0**-150
    assert (np.abs(x - a.qs * step) <= step * 0.5 + np.abs(step) * 127 * 2.0**-21 + tiny).all()
    k = Q.quantize_q8_K(x)
    step = np.abs(np.repeat(k.d, 256, axis=-1))
    assert (np.abs(x - k.qs * np.repeat(k.d, 256, axis=-1)) <= step * 0.5 + step * 127 * 2.0**-21 + tiny).all()
    assert np.array_equal(k.bsums, k.qs.reshape(*x.shape[:-1], -1, 16).sum(-1))


@pytest.mark.parametrize("name", ["Q8_0", "Q2_K", "Q4_K", "IQ2_XXS", "F16", "BF16"])
def test_quantized_weights_decode_the_same_with_the_gguf_package(name):
    t = getattr(Q, name)
    raw = WQ.quantize(gaussian(8, 512, seed=13), t)
    ref = np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(t)), np.float32).reshape(8, 512)
    assert np.array_equal(bits(Q.dequantize(raw, t)), bits(ref))

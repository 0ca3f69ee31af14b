"""Chapter 05: Q/KV projections, RoPE/YaRN, sink attention and the grouped output against ds4.c's recorded ops
(ops_A) and independent formulas."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4ref.attention import (attention_rows, attention_scores, grouped_out_low, layer_grouped_out,
                              layer_kv_projection, layer_q_projection)
from ds4ref.backend import NUMPY
from ds4ref.config import ModelConfig
from ds4ref.quant import quantize_q8_0
from ds4ref.rope import rope_params, rope_tail, rope_theta, yarn_corr_dims, yarn_ramp

from _helpers import rel

FLOAT_TOL = 1e-5  # data/oracle/README.md: float ops within 1e-5 relative


def cases(cfg, positions):
    return [(l, p, f"L{l}.P{p}.") for l in range(cfg.n_layer) for p in positions]


# ---------------------------------------------------------------- Q and KV

def test_q8_activations_before_attention_matvecs_are_exact(ops_A, model, positions):
    cfg, _ = model
    for l, p, k in cases(cfg, positions):
        for src, dst, shape in (("attn_norm", "attn_q_a", None), ("attn_norm", "attn_kv", None),
                                ("qr_norm", "attn_q_b", None), ("heads_unrope", "attn_output_a", (-1,)),
                                ("attn_low", "attn_output_b", (-1,))):
            x = ops_A[k + src] if shape is None else ops_A[k + src].reshape(shape)
            a = quantize_q8_0(x)
            assert np.array_equal(a.qs, ops_A[f"{k}q8.{dst}.qs"]), (k, dst)
            assert np.array_equal(a.d, ops_A[f"{k}q8.{dst}.d"]), (k, dst)


def test_layer_q_projection_matches_ds4c_oracle(ops_A, model, positions):
    cfg, W = model
    worst = 0.0
    for l, p, k in cases(cfg, positions):
        q, qr_norm = layer_q_projection(cfg, W.layers[l], ops_A[k + "attn_norm"], NUMPY)
        assert q.shape == (cfg.n_head, cfg.head_dim) and qr_norm.shape == (cfg.n_lora_q,)
        worst = max(worst, rel(q, ops_A[k + "q_normed"]), rel(qr_norm, ops_A[k + "qr_norm"]))
    assert worst <= 1e-6, worst


def test_layer_kv_projection_matches_ds4c_oracle(ops_A, model, positions):
    cfg, W = model
    worst = max(rel(layer_kv_projection(cfg, W.layers[l], ops_A[k + "attn_norm"], NUMPY), ops_A[k + "kv_normed"])
                for l, p, k in cases(cfg, positions))
    assert worst <= 1e-6, worst


def test_q_projection_batched_equals_per_token(ops_A, model, positions):
    cfg, W = model
    A = np.stack([ops_A[f"L4.P{p}.attn_norm"] for p in positions])
    qb, qrb = layer_q_projection(cfg, W.layers[4], A, NUMPY)
    kvb = layer_kv_projection(cfg, W.layers[4], A, NUMPY)
    for i in range(len(positions)):
        q, qr = layer_q_projection(cfg, W.layers[4], A[i], NUMPY)
        assert rel(qb[i], q) <= 1e-6 and rel(qrb[i], qr) <= 1e-6
        assert rel(kvb[i], layer_kv_projection(cfg, W.layers[4], A[i], NUMPY)) <= 1e-6


# ---------------------------------------------------------------- RoPE

ROPE_CASES = [("q_normed", "q_rope", False, False), ("kv_normed", "kv_rope", False, False),
              ("heads", "heads_unrope", False, True), ("comp_normed", "comp_rope", True, False),
              ("icomp_normed", "icomp_rope", True, False), ("idx_q_raw", "idx_q_rope", False, False)]


@pytest.mark.parametrize("src,dst,at_window_start,inverse", ROPE_CASES)
def test_rope_matches_ds4c_oracle(ops_A, model, positions, src, dst, at_window_start, inverse):
    cfg, _ = model
    n, worst = 0, 0.0
    for l, p, k in cases(cfg, positions):
        if k + dst not in ops_A:
            continue
        ratio = cfg.compress_ratio(l)
        pos = p + 1 - ratio if at_window_start else p
        worst, n = max(worst, rel(rope_tail(ops_A[k + src], pos, cfg, ratio, inverse), ops_A[k + dst])), n + 1
    assert n >= 16 and worst <= FLOAT_TOL, (n, worst)


def test_rope_parameters_follow_the_layer_schedule(model):
    cfg, _ = model
    assert rope_params(cfg, 0)["base"] == 10000 and not rope_params(cfg, 0)["yarn"]
    for ratio in (4, 128):
        prm = rope_params(cfg, ratio)
        assert prm["base"] == 160000 and prm["yarn"] and prm["freq_scale"] == np.float32(1 / 16)
        assert prm["mscale"] == np.float32(1.0) and prm["n_ctx_orig"] == 65536


def test_yarn_correction_range_from_the_formula(model):
    cfg, _ = model
    c = lambda beta: 64 * math.log(65536 / (2 * math.pi * beta)) / (2 * math.log(160000))
    lo, hi = yarn_corr_dims(cfg.n_rot, 65536, 160000.0, 32.0, 1.0)
    assert (lo, hi) == (math.floor(c(32)), math.ceil(c(1))) == (15, 25)
    ramp = yarn_ramp(cfg.n_rot, lo, hi)
    assert np.all(ramp[:16] == 1) and np.all(ramp[25:] == 0) and np.all(np.diff(ramp) <= 0)


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_rope_theta_equals_exact_formula_at_small_positions(model, ratio):
    cfg, _ = model
    pos = np.arange(0, 2000, 37)
    base = 10000.0 if ratio == 0 else 160000.0
    ext = pos[:, None] * base ** (-2 * np.arange(32) / 64.0)
    if ratio:
        ramp = np.clip(1 - (np.arange(32) - 15) / 10.0, 0, 1)
        ext = ext / 16 * (1 - ramp) + ext * ramp
    got = rope_theta(pos, cfg, ratio).astype(np.float64)
    # the float32 recurrence rounds ~32 times: measured 1.3e-6 relative per angle; a wrong base or ramp is far off
    assert np.all(np.abs(got - ext) <= 4e-6 * ext)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**20), st.sampled_from([0, 4, 128]), st.integers(0, 2**31 - 1))
def test_rope_preserves_pair_norms_and_inverse_undoes_it(pos, ratio, seed):
    cfg = ModelConfig.tiny()
    x = np.random.default_rng(seed).standard_normal((3, cfg.n_head, cfg.head_dim)).astype(np.float32)
    y = rope_tail(x, pos, cfg, ratio)
    n_rot = cfg.n_rot
    assert np.array_equal(y[..., :-n_rot], x[..., :-n_rot])
    pair = lambda t: np.hypot(t[..., -n_rot::2].astype(np.float64), t[..., -n_rot + 1::2])
    assert np.allclose(pair(y), pair(x), rtol=2e-6, atol=1e-6)
    assert np.allclose(rope_tail(y, pos, cfg, ratio, inverse=True), x, atol=2e-6)


def test_rope_batched_positions_equal_one_by_one(ops_A, model, positions):
    cfg, _ = model
    Q = np.stack([ops_A[f"L3.P{p}.q_normed"] for p in positions])
    Qr = rope_tail(Q, np.array(positions), cfg, 128)
    for i, p in enumerate(positions):
        assert np.array_equal(Qr[i], rope_tail(Q[i], p, cfg, 128))


def test_rope_errors_name_the_problem(model):
    cfg, _ = model
    with pytest.raises(ValueError, match="pos of shape"):
        rope_tail(np.ones((2, 8, 256), np.float32), np.array([1, 2, 3]), cfg, 0)
    with pytest.raises(ValueError, match="n_rot"):
        rope_tail(np.ones(32, np.float32), 1, cfg, 0)
    with pytest.raises(ValueError, match="positions must be integers"):
        rope_tail(np.ones(256, np.float32), -1, cfg, 0)


@pytest.mark.parametrize("src,dst,at_window_start,inverse", ROPE_CASES)
def test_numba_rope_gives_chapter_5s_bits(ops_A, model, positions, src, dst, at_window_start, inverse):
    """be.rope on numba (the angles' cos and sin once per position and ratio, the pairs rotated in one numba loop)
    equals rope_tail bit for bit on every row ds4.c rotated in case A, the second time from its cache too."""
    from ds4ref.backends import get_backend
    numba = get_backend("numba")
    assert numba.rope is not NUMPY.rope
    cfg, _ = model
    n = 0
    for l, p, k in cases(cfg, positions):
        if k + dst not in ops_A:
            continue
        ratio = cfg.compress_ratio(l)
        pos = p + 1 - ratio if at_window_start else p
        want = rope_tail(ops_A[k + src], pos, cfg, ratio, inverse)
        for _ in range(2):
            got = numba.rope(ops_A[k + src], pos, cfg, ratio, inverse)
            assert got.dtype == np.float32 and np.array_equal(got, want)
        n += 1
    assert n >= 16


def test_numba_rope_refuses_and_batches_as_chapter_5(ops_A, model, positions):
    """What rope_tail refuses, numba's rope refuses with its message; a batch's positions give rope_tail's rows; the
    input is never written."""
    from ds4ref.backends import get_backend
    numba = get_backend("numba")
    cfg, _ = model
    for x, pos, msg in [(np.ones((2, 8, 256), np.float32), np.array([1, 2, 3]), "pos of shape"),
                        (np.ones(32, np.float32), 1, "n_rot"), (np.ones(256, np.float32), -1, "positions must be"),
                        (np.ones(256, np.float32), 1 << 24, "positions must be"),
                        (np.ones(256, np.float32), True, "positions must be")]:
        with pytest.raises(ValueError, match=msg):
            numba.rope(x, pos, cfg, 0)
    Q = np.stack([ops_A[f"L3.P{p}.q_normed"] for p in positions])
    before = Q.copy()
    assert np.array_equal(numba.rope(Q, np.array(positions), cfg, 128), rope_tail(Q, np.array(positions), cfg, 128))
    assert np.array_equal(numba.rope(Q[0], np.int64(positions[0]), cfg, 128), rope_tail(Q[0], positions[0], cfg, 128))
    assert np.array_equal(Q, before)


# ---------------------------------------------------------------- attention

def ds4_rows(ops_A, cfg, k):
    raw = ops_A[k + "cache_raw"]
    comp = ops_A[k + "cache_comp"] if k + "cache_comp" in ops_A else np.zeros((0, cfg.head_dim), np.float32)
    allowed = ops_A[k + "comp_allowed"] if k + "comp_allowed" in ops_A else None
    return np.concatenate([raw, comp]), len(raw), allowed


def test_attention_scores_and_heads_match_ds4c_oracle(ops_A, model, positions):
    cfg, W = model
    worst_s = worst_h = 0.0
    n_masked = 0
    for l, p, k in cases(cfg, positions):
        kv, n_raw, allowed = ds4_rows(ops_A, cfg, k)
        s = attention_scores(ops_A[k + "q_rope"], kv, allowed, n_raw)
        ref = ops_A[k + "attn_scores"]
        masked = ref <= -1e29
        assert np.array_equal(s <= -1e29, masked) and np.all(s[masked] == np.float32(-1e30))
        n_masked += int(masked.sum())
        worst_s = max(worst_s, rel(s[~masked], ref[~masked]))
        heads = attention_rows(ops_A[k + "q_rope"], kv, W.layers[l].attn_sinks, allowed, n_raw)
        worst_h = max(worst_h, rel(heads, ops_A[k + "heads"]))
    assert n_masked > 0  # the indexer masked rows at positions >= 67
    assert worst_s <= FLOAT_TOL and worst_h <= FLOAT_TOL, (worst_s, worst_h)


def sink_attention_f64(q, kv, sinks, visible=None):
    """Softmax over [sink, scores] in float64, then drop the sink's entry: the value-less sink."""
    q, kv, sinks = (np.asarray(t, np.float64) for t in (q, kv, sinks))
    s = q @ kv.T / np.sqrt(q.shape[-1])
    if visible is not None:
        s = np.where(visible[None, :], s, -np.inf)
    logits = np.concatenate([sinks[:, None], s], axis=1)
    pr = np.exp(logits - logits.max(1, keepdims=True))
    pr /= pr.sum(1, keepdims=True)
    return pr[:, 1:] @ kv


def test_sink_attention_equals_softmax_with_the_sink_dropped_on_the_oracle(ops_A, model, positions):
    cfg, W = model
    for l, p, k in cases(cfg, positions):
        kv, n_raw, allowed = ds4_rows(ops_A, cfg, k)
        visible = None if allowed is None else np.concatenate([np.ones(n_raw, bool), allowed.astype(bool)])
        sinks = W.layers[l].attn_sinks.numpy()
        got = attention_rows(ops_A[k + "q_rope"], kv, sinks, allowed, n_raw)
        assert rel(got, sink_attention_f64(ops_A[k + "q_rope"], kv, sinks, visible)) <= FLOAT_TOL


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 40), st.integers(0, 2**31 - 1), st.floats(-5, 5))
def test_sink_attention_on_random_rows(n_rows, seed, sink_shift):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((4, 64)).astype(np.float32) * 3
    kv = rng.standard_normal((n_rows, 64)).astype(np.float32)
    sinks = (rng.standard_normal(4) + sink_shift).astype(np.float32)
    got = attention_rows(q, kv, sinks)
    assert np.allclose(got, sink_attention_f64(q, kv, sinks), rtol=1e-5, atol=1e-5 * np.abs(kv).max())


def test_sink_takes_weight_but_gives_no_value():
    kv = np.ones((3, 8), np.float32)
    q = np.zeros((2, 8), np.float32)                 # every score 0: three rows at e^0, sink at e^sink
    sinks = np.array([0.0, np.log(3.0)], np.float32)
    out = attention_rows(q, kv, sinks)
    assert np.allclose(out[0], 3 / 4) and np.allclose(out[1], 3 / 6)
    very_low = attention_rows(q, kv, np.full(2, -1e30, np.float32))
    assert np.allclose(very_low, 1.0)              # no sink: a plain average of identical rows


def test_no_rows_gives_zero_heads():
    out = attention_rows(np.ones((8, 32), np.float32), np.zeros((0, 32), np.float32), np.zeros(8, np.float32))
    assert out.shape == (8, 32) and np.all(out == 0)


def test_masked_rows_contribute_nothing():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((8, 32)).astype(np.float32)
    raw, comp = rng.standard_normal((5, 32)).astype(np.float32), rng.standard_normal((6, 32)).astype(np.float32)
    allowed = np.array([1, 0, 1, 0, 0, 1], bool)
    sinks = np.zeros(8, np.float32)
    got = attention_rows(q, np.concatenate([raw, comp]), sinks, allowed, n_raw=5)
    want = attention_rows(q, np.concatenate([raw, comp[allowed]]), sinks)
    assert np.allclose(got, want, rtol=1e-6, atol=1e-7)


def test_causal_batch_equals_per_token_prefix(ops_A, model):
    cfg, W = model
    T = 7
    rows = ops_A["L1.P8.cache_raw"][-T:]
    qs = np.stack([ops_A[f"L1.P{p}.q_rope"] for p in (0, 1, 2, 3, 4, 7, 8)])
    batched = attention_rows(qs, np.broadcast_to(rows, (T,) + rows.shape), W.layers[1].attn_sinks,
                             np.tril(np.ones((T, T), bool)))
    for t in range(T):
        assert rel(batched[t], attention_rows(qs[t], rows[:t + 1], W.layers[1].attn_sinks)) <= 1e-6


def test_attention_errors_name_the_problem():
    q, kv = np.ones((8, 32), np.float32), np.ones((5, 32), np.float32)
    with pytest.raises(ValueError, match="allowed has shape"):
        attention_rows(q, kv, np.zeros(8, np.float32), np.ones(4, bool), n_raw=2)
    with pytest.raises(ValueError, match="sinks has shape"):
        attention_rows(q, kv, np.zeros(7, np.float32))
    with pytest.raises(ValueError, match="must be"):
        attention_scores(q, np.ones((5, 16), np.float32))


# ---------------------------------------------------------------- grouped output

def test_grouped_output_matches_ds4c_oracle(ops_A, model, positions):
    cfg, W = model
    worst_low = worst_out = 0.0
    for l, p, k in cases(cfg, positions):
        Lw = W.layers[l]
        worst_low = max(worst_low, rel(grouped_out_low(ops_A[k + "heads_unrope"], Lw.attn_output_a, cfg, NUMPY), ops_A[k + "attn_low"]))
        out = layer_grouped_out(ops_A[k + "heads_unrope"], Lw.attn_output_a, Lw.attn_output_b, cfg, NUMPY)
        assert out.shape == (cfg.n_embd,)
        worst_out = max(worst_out, rel(out, ops_A[k + "attn_out"]))
    assert worst_low <= 1e-6 and worst_out <= 1e-6, (worst_low, worst_out)


def test_grouped_output_uses_each_groups_own_rows(model):
    """Group g of the heads meets rows g*rank.. of attn_output_a only: zero the other groups' heads and
    the low vector's other groups are exactly zero."""
    cfg, W = model
    heads = np.zeros((cfg.n_head, cfg.head_dim), np.float32)
    hpg = cfg.n_head // cfg.n_out_group
    heads[hpg:2 * hpg] = np.random.default_rng(2).standard_normal((hpg, cfg.head_dim))
    low = grouped_out_low(heads, W.layers[0].attn_output_a, cfg, NUMPY)
    assert np.all(low[[0, 2, 3]] == 0) and np.any(low[1] != 0)
    rows = W.layers[0].attn_output_a.data[cfg.n_lora_o:2 * cfg.n_lora_o]
    assert np.array_equal(low[1], NUMPY.matvec_q8_0(rows, heads[hpg:2 * hpg].reshape(-1)))


def test_grouped_output_batched_equals_per_token(ops_A, model, positions):
    cfg, W = model
    H = np.stack([ops_A[f"L5.P{p}.heads_unrope"] for p in positions])
    Lw = W.layers[5]
    out = layer_grouped_out(H, Lw.attn_output_a, Lw.attn_output_b, cfg, NUMPY)
    for i in range(len(positions)):
        assert rel(out[i], layer_grouped_out(H[i], Lw.attn_output_a, Lw.attn_output_b, cfg, NUMPY)) <= 1e-6

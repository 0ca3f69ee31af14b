"""Chapter 04: RMSNorms and hyper-connections against ds4.c's recorded ops (ops_A) and independent formulas."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4ref.backend import NUMPY
from ds4ref.hc import (hc_from_plain_embedding, hc_mix, hc_post, hc_pre, hc_split_sinkhorn, hc_weighted_sum,
                       output_hc_head, output_hc_weights)
from ds4ref.norms import head_rms_norm, rms_norm_no_weight, rms_norm_weight

from _helpers import rel

FLOAT_TOL = 1e-5  # data/oracle/README.md: float ops within 1e-5 relative


# ---------------------------------------------------------------- RMSNorm

@pytest.mark.parametrize("src,dst,weight", [
    ("attn_x", "attn_norm", "attn_norm"), ("qr", "qr_norm", "attn_q_a_norm"), ("q_b", "q_normed", None),
    ("kv_raw", "kv_normed", "attn_kv_a_norm"), ("ffn_x", "ffn_norm", "ffn_norm")])
def test_norms_match_ds4c_oracle_every_layer_and_position(ops_A, model, positions, src, dst, weight):
    cfg, W = model
    worst = 0.0
    for l in range(cfg.n_layer):
        for p in positions:
            x = ops_A[f"L{l}.P{p}.{src}"]
            y = head_rms_norm(x, cfg.rms_eps) if weight is None else rms_norm_weight(x, getattr(W.layers[l], weight), cfg.rms_eps)
            assert y.dtype == np.float32 and y.shape == x.shape
            worst = max(worst, rel(y, ops_A[f"L{l}.P{p}.{dst}"]))
    assert worst <= 1e-6, f"{src}->{dst}: {worst:.2e}"


def test_output_norm_matches_ds4c_oracle(ops_A, model, positions):
    cfg, W = model
    for p in positions:
        assert rel(rms_norm_weight(ops_A[f"P{p}.out_embd"], W.output_norm), ops_A[f"P{p}.out_norm"]) <= 1e-6


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 600), st.integers(0, 2**31 - 1), st.floats(1e-3, 1e3))
def test_rms_norm_equals_float64_formula(n, seed, scale):
    x = (np.random.default_rng(seed).standard_normal((3, n)) * scale).astype(np.float32)
    w = np.random.default_rng(seed + 1).standard_normal(n).astype(np.float32)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6)
    assert np.allclose(rms_norm_no_weight(x), ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())
    assert np.allclose(rms_norm_weight(x, w), ref * w, rtol=1e-6, atol=1e-6 * np.abs(ref * w).max())


def test_head_rms_norm_gives_unit_rms_per_head():
    x = np.random.default_rng(3).standard_normal((5, 8, 256)).astype(np.float32) * np.arange(1, 9)[:, None]
    y = head_rms_norm(x)
    assert np.allclose(np.sqrt((y.astype(np.float64) ** 2).mean(-1)), 1.0, atol=1e-6)


def test_rms_norm_sum_of_squares_is_float64():
    # x[0]^2 = 2^24, then 4095 ones: a left-to-right float32 sum drops every one (2^24 + 1 rounds back
    # to 2^24) and gives scale 1/64; the float64 sum keeps them
    x = np.ones(1 << 12, np.float32)
    x[0] = 4096.0
    ss = 4096.0 ** 2 + (len(x) - 1)
    want = np.float32(1) / np.sqrt(np.float32(ss / len(x)) + np.float32(1e-6))
    assert rms_norm_no_weight(x)[1] == want


def test_norm_errors_name_the_problem():
    with pytest.raises(ValueError, match="rms_norm_weight: weight has shape"):
        rms_norm_weight(np.ones(8, np.float32), np.ones(7, np.float32))
    with pytest.raises(ValueError, match="head_rms_norm"):
        head_rms_norm(np.ones(8, np.float32))


# ---------------------------------------------------------------- hyper-connections

SUBLAYERS = [("attn", "hc_in"), ("ffn", "after_attn_hc")]


def _hc_weights(Lw, s):
    return getattr(Lw, f"hc_{s}_fn"), getattr(Lw, f"hc_{s}_scale"), getattr(Lw, f"hc_{s}_base")


@pytest.mark.parametrize("s,xkey", SUBLAYERS)
def test_hc_mix_split_and_weighted_sum_match_ds4c_oracle(ops_A, model, positions, s, xkey):
    cfg, W = model
    worst = {"mix": 0.0, "split": 0.0, "x": 0.0}
    for l in range(cfg.n_layer):
        fn, scale, base = _hc_weights(W.layers[l], s)
        for p in positions:
            k = f"L{l}.P{p}."
            worst["mix"] = max(worst["mix"], rel(hc_mix(ops_A[k + xkey], fn, cfg, NUMPY), ops_A[f"{k}{s}_hc_mix"]))
            pre, post, comb = hc_split_sinkhorn(ops_A[f"{k}{s}_hc_mix"], scale, base, cfg.n_hc, cfg.hc_sinkhorn_iter, cfg.hc_eps)
            split = ops_A[f"{k}{s}_hc_split"]
            worst["split"] = max(worst["split"], rel(np.concatenate([pre, post, comb.ravel()]), split))
            worst["x"] = max(worst["x"], rel(hc_weighted_sum(ops_A[k + xkey], split[:cfg.n_hc]), ops_A[f"{k}{s}_x"]))
    assert max(worst.values()) <= FLOAT_TOL, worst


@pytest.mark.parametrize("s,xkey", SUBLAYERS)
def test_hc_pre_matches_ds4c_oracle(ops_A, model, positions, s, xkey):
    cfg, W = model
    worst = 0.0
    for l in range(cfg.n_layer):
        fn, scale, base = _hc_weights(W.layers[l], s)
        for p in positions:
            k = f"L{l}.P{p}."
            x, post, comb = hc_pre(ops_A[k + xkey], fn, scale, base, cfg, NUMPY)
            assert x.shape == (cfg.n_embd,) and post.shape == (cfg.n_hc,) and comb.shape == (cfg.n_hc, cfg.n_hc)
            worst = max(worst, rel(x, ops_A[f"{k}{s}_x"]), rel(post, ops_A[f"{k}{s}_post"]),
                        rel(comb, ops_A[f"{k}{s}_comb"]))
    assert worst <= FLOAT_TOL, worst


def test_hc_post_matches_ds4c_oracle(ops_A, model, positions):
    cfg, _ = model
    worst = 0.0
    for l in range(cfg.n_layer):
        for p in positions:
            k = f"L{l}.P{p}."
            worst = max(worst,
                        rel(hc_post(ops_A[k + "attn_out"], ops_A[k + "hc_in"], ops_A[k + "attn_post"], ops_A[k + "attn_comb"]),
                            ops_A[k + "after_attn_hc"]),
                        rel(hc_post(ops_A[k + "ffn_out"], ops_A[k + "after_attn_hc"], ops_A[k + "ffn_post"], ops_A[k + "ffn_comb"]),
                            ops_A[k + "hc_out"]))
    assert worst <= 1e-6, worst


def test_output_hc_head_matches_ds4c_oracle(ops_A, model, positions):
    cfg, W = model
    for p in positions:
        X = ops_A[f"L{cfg.n_layer - 1}.P{p}.hc_out"]
        assert rel(hc_mix(X, W.output_hc_fn, cfg, NUMPY), ops_A[f"P{p}.out_hc_mix"]) <= FLOAT_TOL
        assert rel(output_hc_weights(ops_A[f"P{p}.out_hc_mix"], W.output_hc_scale, W.output_hc_base, cfg.hc_eps),
                   ops_A[f"P{p}.out_hc_w"]) <= 1e-6
        e = output_hc_head(X, W.output_hc_fn, W.output_hc_scale, W.output_hc_base, cfg, NUMPY)
        assert rel(e, ops_A[f"P{p}.out_embd"]) <= FLOAT_TOL


def test_hc_from_plain_embedding_is_ds4cs_first_state(ops_A, model, positions):
    cfg, _ = model
    for p in positions:
        assert np.array_equal(hc_from_plain_embedding(ops_A[f"P{p}.embd"], cfg.n_hc), ops_A[f"L0.P{p}.hc_in"])


def _random_split_inputs(seed, n=4):
    """Logits of the size the oracle shows (|Z| up to ~4)."""
    rng = np.random.default_rng(seed)
    mix = rng.standard_normal(2 * n + n * n).astype(np.float32)
    scale = rng.uniform(0.1, 1, 3).astype(np.float32)
    base = rng.standard_normal(2 * n + n * n).astype(np.float32)
    return mix, scale, base


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_sinkhorn_is_doubly_stochastic(seed):
    """Run long enough, the split converges to a doubly stochastic comb (up to the 1e-6 eps)."""
    mix, scale, base = _random_split_inputs(seed)
    pre, post, comb = hc_split_sinkhorn(mix, scale, base, iters=1000)
    assert np.all(comb > 0)
    assert np.abs(comb.sum(-1) - 1).max() <= 1e-5 and np.abs(comb.sum(-2) - 1).max() <= 1e-5
    assert np.all((pre > 0) & (pre <= 1 + 1e-6)) and np.all((post > 0) & (post < 2))


def test_sinkhorn_at_ds4cs_20_passes_on_the_oracle(ops_A, model, positions):
    """ds4.c stops at 20 passes: the columns are normalised last (1e-5), the rows only to ~2e-3;
    100 passes on the same inputs make both within 1e-5."""
    cfg, W = model
    for l in range(cfg.n_layer):
        for s in ("attn", "ffn"):
            _, scale, base = _hc_weights(W.layers[l], s)
            for p in positions:
                _, _, comb = hc_split_sinkhorn(ops_A[f"L{l}.P{p}.{s}_hc_mix"], scale, base, iters=100)
                assert np.abs(comb.sum(-1) - 1).max() <= 1e-5 and np.abs(comb.sum(-2) - 1).max() <= 1e-5
    combs = np.stack([ops_A[f"L{l}.P{p}.{s}_comb"] for l in range(cfg.n_layer) for p in positions for s in ("attn", "ffn")])
    assert np.abs(combs.sum(-2) - 1).max() <= 1e-5
    assert np.abs(combs.sum(-1) - 1).max() <= 3e-3


def test_sinkhorn_first_pass_is_row_softmax_plus_eps_then_column_norm():
    mix, scale, base = _random_split_inputs(11)
    z = (mix[8:].astype(np.float64) * scale[2] + base[8:]).reshape(4, 4)
    c = np.exp(z - z.max(1, keepdims=True))
    c = c / c.sum(1, keepdims=True) + 1e-6
    c = c / (c.sum(0, keepdims=True) + 1e-6)
    _, _, comb = hc_split_sinkhorn(mix, scale, base, iters=1)
    assert np.allclose(comb, c, rtol=1e-6, atol=1e-7)


def test_pre_and_post_gates_follow_the_formula_with_eps():
    """pre = sigmoid(z) + 1e-6 and post = 2 sigmoid(z), z = mix * scale + base: checked against float64
    sigmoids of the same float32 logits, tightly enough that a missing eps (1e-6) or factor 2 fails."""
    for seed in range(20):
        mix, scale, base = _random_split_inputs(seed)
        pre, post, _ = hc_split_sinkhorn(mix, scale, base)
        z_pre = (mix[:4] * scale[0] + base[:4]).astype(np.float64)
        z_post = (mix[4:8] * scale[1] + base[4:8]).astype(np.float64)
        assert np.all(np.abs(pre - (1 / (1 + np.exp(-z_pre)) + 1e-6)) <= 3e-7 * pre)
        assert np.all(np.abs(post - 2 / (1 + np.exp(-z_post))) <= 3e-7 * post)


def test_hc_post_keeps_the_sum_of_streams(ops_A, model, positions):
    """Rows of comb sum to ~1, so sum_d X'_d = sum_s X_s + sum(post) * y (to the rows' 2e-3), both for
    our hc_post with our own hc_pre weights and for ds4.c's recorded state."""
    cfg, W = model
    for l in range(cfg.n_layer):
        fn, scale, base = _hc_weights(W.layers[l], "attn")
        for p in positions:
            k = f"L{l}.P{p}."
            X, y = ops_A[k + "hc_in"], ops_A[k + "attn_out"]
            _, post, comb = hc_pre(X, fn, scale, base, cfg, NUMPY)
            assert rel(hc_post(y, X, post, comb).sum(0), X.sum(0) + post.sum() * y) <= 1e-3
            want = X.sum(0) + ops_A[k + "attn_post"].sum() * y
            assert rel(ops_A[k + "after_attn_hc"].sum(0), want) <= 1e-3


def test_hc_pre_batched_equals_per_token(ops_A, model, positions):
    cfg, W = model
    fn, scale, base = _hc_weights(W.layers[3], "attn")
    Xb = np.stack([ops_A[f"L3.P{p}.hc_in"] for p in positions])
    xb, postb, combb = hc_pre(Xb, fn, scale, base, cfg, NUMPY)
    assert xb.shape == (len(positions), cfg.n_embd) and combb.shape == (len(positions), cfg.n_hc, cfg.n_hc)
    for i, X in enumerate(Xb):
        x, post, comb = hc_pre(X, fn, scale, base, cfg, NUMPY)
        assert rel(xb[i], x) <= 1e-6 and rel(postb[i], post) <= 1e-6 and rel(combb[i], comb) <= 1e-6
    yb = np.stack([ops_A[f"L3.P{p}.attn_out"] for p in positions])
    outb = hc_post(yb, Xb, postb, combb)
    for i in range(len(positions)):
        assert np.array_equal(outb[i], hc_post(yb[i], Xb[i], postb[i], combb[i]))


def test_hc_pre_is_scale_invariant_up_to_eps(ops_A, model):
    cfg, W = model
    fn, scale, base = _hc_weights(W.layers[2], "attn")
    X = ops_A["L2.P67.hc_in"]
    x1, post1, comb1 = hc_pre(X, fn, scale, base, cfg, NUMPY)
    x2, post2, comb2 = hc_pre(8 * X, fn, scale, base, cfg, NUMPY)
    assert rel(x2, 8 * x1) <= 1e-5 and rel(post2, post1) <= 1e-5 and rel(comb2, comb1) <= 1e-5


def test_hc_errors_name_the_problem(model):
    cfg, W = model
    fn, scale, base = _hc_weights(W.layers[0], "attn")
    with pytest.raises(ValueError, match=r"hc_pre: HC state has shape \(3, 256\)"):
        hc_pre(np.ones((3, 256), np.float32), fn, scale, base, cfg, NUMPY)
    with pytest.raises(ValueError, match="hc_split_sinkhorn: mix"):
        hc_split_sinkhorn(np.ones(23, np.float32), scale, base)
    with pytest.raises(ValueError, match="iters must be >= 1"):
        hc_split_sinkhorn(np.ones(24, np.float32), scale, base, iters=0)
    with pytest.raises(ValueError, match="hc_post"):
        hc_post(np.ones(255, np.float32), np.ones((4, 256), np.float32), np.ones(4), np.ones((4, 4)))


# ---------------------------------------------------------------- the split as backend glue

def test_numba_sinkhorn_split_gives_numpys_bits(ops_A, model):
    """be.hc_split_sinkhorn on numba (numpy's first pass, 19 rounds in a numba loop) equals chapter 4's function bit
    for bit: every recorded mix of case A, a batch of them, and random mixes up to where exp overflows; hc_pre on
    both backends agrees bit for bit too. Independent of appendix D's check, which runs the same comparison on
    other inputs."""
    from ds4ref.backends import get_backend
    numba = get_backend("numba")
    cfg, W = model
    keys = [k for k in ops_A.files if k.startswith("L") and k.endswith((".attn_hc_mix", ".ffn_hc_mix"))]
    assert len(keys) >= 2 * cfg.n_layer
    rng = np.random.default_rng(11)
    cases = [(ops_A[k], W.layers[int(k[1:k.index(".")])], k.rsplit(".", 1)[1][:-len("_hc_mix")]) for k in keys]
    cases += [(np.stack([ops_A[k].reshape(-1) for k in keys[:5]]), W.layers[0], "ffn")]
    cases += [(rng.standard_normal((2, 3, 24)).astype(np.float32) * f, W.layers[1], "attn") for f in (0.01, 3.0, 300.0)]
    with np.errstate(over="ignore"):
        for mix, lw, s in cases:
            args = (mix, getattr(lw, f"hc_{s}_scale"), getattr(lw, f"hc_{s}_base"), cfg.n_hc, cfg.hc_sinkhorn_iter,
                    cfg.hc_eps)
            want, got = hc_split_sinkhorn(*args), numba.hc_split_sinkhorn(*args)
            assert all(g.dtype == np.float32 and g.shape == w.shape and np.array_equal(g, w) for g, w in zip(got, want))
    assert numba.hc_split_sinkhorn is not NUMPY.hc_split_sinkhorn
    calls = []

    class Counting(type(NUMPY)):               # hc_pre splits through its backend
        def hc_split_sinkhorn(self, mix, scale, base, n_hc, iters, eps):
            calls.append((mix.shape, n_hc, iters, eps))
            return super().hc_split_sinkhorn(mix, scale, base, n_hc, iters, eps)
    X = rng.standard_normal((3, cfg.n_hc, cfg.n_embd)).astype(np.float32)
    lw = W.layers[2]
    got = hc_pre(X, lw.hc_attn_fn, lw.hc_attn_scale, lw.hc_attn_base, cfg, Counting())
    want = hc_pre(X, lw.hc_attn_fn, lw.hc_attn_scale, lw.hc_attn_base, cfg, NUMPY)
    assert calls == [((3, 2 * cfg.n_hc + cfg.n_hc ** 2), cfg.n_hc, cfg.hc_sinkhorn_iter, cfg.hc_eps)]
    assert all(np.array_equal(u, v) for u, v in zip(got, want))
    with pytest.raises(ValueError, match="iters must be >= 1"):
        numba.hc_split_sinkhorn(cases[0][0], W.layers[0].hc_attn_scale, W.layers[0].hc_attn_base, cfg.n_hc, 0, cfg.hc_eps)

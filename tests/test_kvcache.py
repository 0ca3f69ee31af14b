"""Chapter 06: KV cache, compressor, indexer and the attention sub-layer, against ds4.c's recorded ops (ops_A)."""
from __future__ import annotations

import numpy as np
import pytest

from ds4ref.backend import NUMPY
from ds4ref.attention import attention_scores
from ds4ref.attention_layer import attention_mixed
from ds4ref.compressor import (CompressorError, CompressorLane, compressor_advance_state, compressor_decode_one, compressor_norm,
                               compressor_pool, compressor_project, compressor_update_state, compressor_window)
from ds4ref.config import ModelConfig
from ds4ref.indexer import (IndexerError, indexer_allowed, indexer_query, indexer_scores, indexer_topk,
                            indexer_weights)
from ds4ref.kvcache import KVCache, KVCacheError, LayerCache, kv_cache_bytes
from ds4ref.quant import f16_round
from ds4ref.kvquant import fp8_kv_quantize_row, indexer_qat_row
from ds4ref.rope import rope_tail

from _helpers import attention_batch, attention_one, rel

LANES = {"comp": "attn_compressor", "icomp": "indexer_compressor"}


@pytest.fixture(scope="module")
def ops(ops_A):
    return {k: ops_A[k] for k in ops_A.files}       # decompress once


@pytest.fixture(scope="module")
def positions(ops):
    return [int(p) for p in ops["positions"]]


def seeded_cache(cfg, ops, il, p):
    """ds4.c's cache state of layer il just before position p, rebuilt from its dumps at p."""
    k, r = f"L{il}.P{p}.", cfg.compress_ratio(il)
    c = LayerCache(cfg, il, 1024)
    for row in ops[k + "cache_raw"][:-1]:
        c.push_raw(row)
    emit = bool(r) and (p + 1) % r == 0
    if r:
        for row in ops[k + "cache_comp"][:len(ops[k + "cache_comp"]) - emit]:
            c.push_comp(row)
        if emit:
            c.attn_state_kv[:], c.attn_state_score[:] = ops[k + "comp_state_kv"], ops[k + "comp_state_score"]
    if r == 4:
        for row in ops[k + "cache_icomp"][:len(ops[k + "cache_icomp"]) - emit]:
            c.push_index_comp(row)
        if emit:
            c.index_state_kv[:], c.index_state_score[:] = ops[k + "icomp_state_kv"], ops[k + "icomp_state_score"]
    return c


# ---------------------------------------------------------------- rounding of cached rows (exact)

def test_kv_rounding_matches_ds4c_bit_for_bit(model, ops, positions):
    cfg, _ = model
    n = 0
    for il in range(cfg.n_layer):
        for p in positions:
            k = f"L{il}.P{p}."
            np.testing.assert_array_equal(fp8_kv_quantize_row(ops[k + "kv_rope"], cfg.n_rot), ops[k + "kv_fp8"])
            np.testing.assert_array_equal(f16_round(ops[k + "kv_fp8"]), ops[k + "kv_stored"])
            for nm in LANES:
                if k + nm + "_rope" in ops:
                    rnd = fp8_kv_quantize_row if nm == "comp" else (lambda x, _: indexer_qat_row(x))
                    np.testing.assert_array_equal(rnd(ops[k + nm + "_rope"], cfg.n_rot), ops[k + nm + "_row"])
                    np.testing.assert_array_equal(f16_round(ops[k + nm + "_row"]), ops[k + nm + "_stored"])
                    n += 1
    assert n == 36      # ratio 4: 8 emission positions x 2 layers x 2 lanes; ratio 128: 2 x 2


def test_layer_cache_push_rounds_to_f16(model, ops):
    cfg, _ = model
    c = LayerCache(cfg, 2, 64)
    c.push_raw(ops["L2.P64.kv_fp8"])
    np.testing.assert_array_equal(c.raw_rows[-1], ops["L2.P64.kv_stored"])
    c.push_comp(ops["L2.P67.comp_row"])
    np.testing.assert_array_equal(c.comp_rows[-1], ops["L2.P67.comp_stored"])
    c.push_index_comp(ops["L2.P67.icomp_row"])
    np.testing.assert_array_equal(c.index_rows[-1], ops["L2.P67.icomp_stored"])


# ---------------------------------------------------------------- cache contents along ds4's rows

def test_raw_window_matches_ds4c_cache_at_every_dumped_position(model, ops, positions):
    cfg, _ = model
    for il in range(cfg.n_layer):
        rows = np.zeros((300, cfg.head_dim), np.float32)
        for p in (127, 255, 299):
            c = ops[f"L{il}.P{p}.cache_raw"]
            rows[p + 1 - len(c):p + 1] = c
        cache = LayerCache(cfg, il, 1024)
        for p in range(300):
            cache.push_raw(rows[p])
            assert cache.n_raw == min(p + 1, cfg.n_swa)
            if p in positions[1:]:       # P0 comes from a separate run (oracle README)
                np.testing.assert_array_equal(cache.raw_rows, ops[f"L{il}.P{p}.cache_raw"])
                np.testing.assert_array_equal(cache.raw_rows[-1], ops[f"L{il}.P{p}.kv_stored"])


def test_compressed_caches_match_ds4c_at_every_dumped_position(model, ops, positions):
    cfg, _ = model
    for il in range(2, cfg.n_layer):
        r = cfg.compress_ratio(il)
        comp, cache = ops[f"L{il}.P299.cache_comp"], LayerCache(cfg, il, 1024)
        icomp = ops.get(f"L{il}.P299.cache_icomp")
        assert len(comp) == 300 // r
        for p in range(300):
            if (p + 1) % r == 0:
                cache.push_comp(comp[cache.n_comp])
                if r == 4:
                    cache.push_index_comp(icomp[cache.n_index_comp])
            if p in positions[1:]:
                assert cache.n_comp == (p + 1) // r
                np.testing.assert_array_equal(cache.comp_rows, ops[f"L{il}.P{p}.cache_comp"])
                if r == 4:
                    np.testing.assert_array_equal(cache.index_rows, ops[f"L{il}.P{p}.cache_icomp"])


# ---------------------------------------------------------------- compressor

def test_compressor_projections_match_ds4c(model, ops, positions):
    cfg, w = model
    worst, n = 0.0, 0
    for il in range(2, cfg.n_layer):
        lw, r = w.layers[il], cfg.compress_ratio(il)
        for p in positions:
            for nm, pre in LANES.items():
                k = f"L{il}.P{p}."
                if k + nm + "_kv" not in ops:
                    continue
                n += 1
                kv, sc = compressor_project(ops[k + "attn_norm"], getattr(lw, pre + "_kv"),
                                            getattr(lw, pre + "_gate"), getattr(lw, pre + "_ape"), p, r, NUMPY)
                worst = max(worst, rel(kv, ops[k + nm + "_kv"]), rel(sc, ops[k + nm + "_score"]))
    assert n == 17 * (2 + 2 * 2)    # every dumped position: 2 ratio-128 layers x 1 lane + 2 ratio-4 layers x 2 lanes
    assert worst <= 1e-5, worst


def test_compressor_pooling_and_norm_match_ds4c(model, ops, positions):
    cfg, w = model
    n, worst_pool, worst_norm = 0, 0.0, 0.0
    for il in range(2, cfg.n_layer):
        lw, r = w.layers[il], cfg.compress_ratio(il)
        for p in positions:
            for nm, pre in LANES.items():
                k = f"L{il}.P{p}.{nm}_"
                if k + "state_kv" not in ops:
                    continue
                n += 1
                pooled = compressor_pool(ops[k + "state_kv"], ops[k + "state_score"], r)
                worst_pool = max(worst_pool, rel(pooled, ops[k + "pooled"]))
                normed = compressor_norm(ops[k + "pooled"], getattr(lw, pre + "_norm"), cfg.rms_eps)
                worst_norm = max(worst_norm, rel(normed, ops[k + "normed"]))
                ratio_rope = rope_tail(ops[k + "normed"], p + 1 - r, cfg, r)
                assert rel(ratio_rope, ops[k + "rope"]) <= 1e-5
    assert n == 36
    assert worst_pool <= 1e-5 and worst_norm <= 1e-5, (worst_pool, worst_norm)


def test_compressor_decode_one_reproduces_ds4c_emissions(model, ops, positions):
    """Feed ds4's state (rows other than this token's) and attn_norm; the new rows match ds4.c's."""
    cfg, w = model
    n = 0
    for il in range(2, cfg.n_layer):
        lw, r = w.layers[il], cfg.compress_ratio(il)
        for p in positions:
            if (p + 1) % r or p == 0:
                continue
            for nm, pre in LANES.items():
                k = f"L{il}.P{p}."
                if k + nm + "_state_kv" not in ops:
                    continue
                skv, ssc = ops[k + nm + "_state_kv"].copy(), ops[k + nm + "_state_score"].copy()
                n += 1
                lane = CompressorLane("attn" if nm == "comp" else "index", getattr(lw, pre + "_kv"),
                                      getattr(lw, pre + "_gate"), getattr(lw, pre + "_ape"),
                                      getattr(lw, pre + "_norm"), skv, ssc)
                c = compressor_decode_one(cfg, il, lane, ops[k + "attn_norm"], p, NUMPY)
                assert rel(c.row, ops[k + nm + "_row"]) <= 1e-5
                assert rel(c.pooled, ops[k + nm + "_pooled"]) <= 1e-5
                if r == 4:   # the current window became the previous one
                    np.testing.assert_array_equal(skv[:4], skv[4:])
    assert n == 36      # the same 36 emissions as the rounding test (no P0 emission exists)


def test_compressor_windows_cover_the_tokens_ds4c_pools(model, ops):
    """One-hot tokens streamed through the state pool exactly the formula's window ..."""
    for ratio, n_tok in ((4, 40), (128, 400)):
        coff = 2 if ratio == 4 else 1
        skv = np.zeros((coff * ratio, coff * n_tok), np.float32)
        ssc = np.full_like(skv, -1e30)
        emitted = []
        for p in range(n_tok):
            onehot = np.zeros(n_tok, np.float32)
            onehot[p] = 1
            if compressor_update_state(skv, ssc, np.tile(onehot, coff), np.zeros(coff * n_tok, np.float32), p, ratio):
                covered = np.flatnonzero(compressor_pool(skv, ssc, ratio))
                assert covered.tolist() == list(compressor_window(p, ratio))
                np.testing.assert_allclose(compressor_pool(skv, ssc, ratio)[covered], 1 / len(covered), rtol=1e-6)
                compressor_advance_state(skv, ssc, ratio)
                emitted.append(p)
        assert emitted == list(range(ratio - 1, n_tok, ratio))
    assert list(compressor_window(3, 4)) == [0, 1, 2, 3]
    assert list(compressor_window(11, 4)) == list(range(4, 12))
    assert list(compressor_window(255, 128)) == list(range(128, 256))
    # ... and ds4.c's dumped states hold those tokens' projections in those rows
    cfg, _ = model
    for il, p, rows in [(2, 67, {3: 63, 4: 64, 7: 67}), (4, 7, {3: 3, 4: 4, 7: 7}), (4, 131, {3: 127, 7: 131}),
                        (3, 127, {1: 1, 63: 63, 127: 127}), (5, 255, {0: 128, 1: 129, 3: 131, 127: 255})]:
        for row, t in rows.items():
            np.testing.assert_array_equal(ops[f"L{il}.P{p}.comp_state_kv"][row], ops[f"L{il}.P{t}.comp_kv"])
            if cfg.compress_ratio(il) == 4:
                np.testing.assert_array_equal(ops[f"L{il}.P{p}.icomp_state_kv"][row], ops[f"L{il}.P{t}.icomp_kv"])
    with pytest.raises(CompressorError):
        compressor_window(5, 4)


def test_first_ratio4_window_ignores_the_empty_previous_lane():
    skv = np.zeros((8, 2 * 3), np.float32)
    ssc = np.full_like(skv, -1e30)
    for p in range(4):
        compressor_update_state(skv, ssc, np.full(6, p + 1.0, np.float32), np.zeros(6, np.float32), p, 4)
    # only rows 4-7 (tokens 0..3, values 1..4, equal scores) count: mean 2.5 in every dim
    np.testing.assert_allclose(compressor_pool(skv, ssc, 4), 2.5, rtol=1e-6)
    # a dimension that never got a score pools to exactly 0
    assert compressor_pool(np.zeros((128, 2), np.float32), np.full((128, 2), -1e30, np.float32), 128).tolist() == [0, 0]


# ---------------------------------------------------------------- indexer

def test_indexer_ops_match_ds4c(model, ops, positions):
    cfg, w = model
    n = 0
    for il in (2, 4):
        lw = w.layers[il]
        for p in positions:
            k = f"L{il}.P{p}."
            if k + "idx_q_raw" not in ops:
                assert p < 67 or k + "comp_allowed" not in ops
                continue
            n += 1
            q_raw, q_rope, q = indexer_query(cfg, lw, il, ops[k + "qr_norm"], p, NUMPY)
            assert rel(q_raw, ops[k + "idx_q_raw"]) <= 1e-5
            np.testing.assert_array_equal(indexer_qat_row(ops[k + "idx_q_rope"]), ops[k + "idx_q"])
            w_raw, wts = indexer_weights(cfg, lw, ops[k + "attn_norm"], NUMPY)
            assert rel(w_raw, ops[k + "idx_w_raw"]) <= 1e-5 and rel(wts, ops[k + "idx_w"]) <= 1e-5
            s = indexer_scores(ops[k + "idx_q"], ops[k + "idx_w"], ops[k + "cache_icomp"])
            assert rel(s, ops[k + "idx_scores"]) <= 1e-5
    assert n == 16     # positions 67, 127, 128, 129, 131, 255, 256, 299 on layers 2 and 4


def test_indexer_selection_is_exact(model, ops, positions):
    cfg, _ = model
    n = 0
    for il in (2, 4):
        for p in positions:
            k = f"L{il}.P{p}."
            if k + "idx_scores" not in ops:
                continue
            n += 1
            sel = indexer_topk(ops[k + "idx_scores"], cfg.indexer_top_k)
            np.testing.assert_array_equal(sel, ops[k + "idx_selected"])
            mask = np.zeros(len(ops[k + "idx_scores"]), np.int8)
            mask[sel] = 1
            np.testing.assert_array_equal(mask, ops[k + "comp_allowed"])
            # from our own scores: equal unless ds4's own margin is tiny
            ours = indexer_topk(indexer_scores(ops[k + "idx_q"], ops[k + "idx_w"], ops[k + "cache_icomp"]),
                                cfg.indexer_top_k)
            s = ops[k + "idx_scores"]
            margin = s[sel].min() - np.delete(s, sel).max()
            assert np.array_equal(ours, sel) or margin < 1e-5 * np.abs(s).max()
    assert n == 16


def test_indexer_keeps_exactly_top_k_and_breaks_ties_low(model):
    cfg, _ = model
    rng = np.random.default_rng(3)
    for n in (17, 33, 100, 301):
        s = rng.integers(0, 5, n).astype(np.float32)        # many ties
        sel = indexer_topk(s, 16)
        assert len(sel) == 16 and len(set(sel.tolist())) == 16
        # reference: ds4.c's rule, k times the first strictly greater unselected score
        taken = np.zeros(n, bool)
        for _ in range(16):
            best, best_s = 0, -1e30
            for c in range(n):
                if not taken[c] and s[c] > best_s:
                    best, best_s = c, s[c]
            taken[best] = True
        np.testing.assert_array_equal(sel, np.flatnonzero(taken))
    assert indexer_topk(np.array([1, 3, 3, 0, 3], np.float32), 2).tolist() == [1, 2]
    with pytest.raises(IndexerError):
        indexer_topk(np.array([1, np.nan], np.float32), 1)


def test_indexer_allows_everything_up_to_top_k(model, ops):
    cfg, w = model
    k, lw = "L2.P63.", w.layers[2]
    rows = ops[k + "cache_icomp"]
    assert len(rows) == cfg.indexer_top_k
    allowed, idx = indexer_allowed(cfg, lw, 2, ops[k + "attn_norm"], ops[k + "qr_norm"], rows, 63, NUMPY)
    assert allowed.all() and idx is None                                      # no choice to make
    assert indexer_allowed(cfg, lw, 2, ops[k + "attn_norm"], ops[k + "qr_norm"], rows[:0], 63, NUMPY) == (None, None)
    k = "L2.P67."
    allowed, idx = indexer_allowed(cfg, lw, 2, ops[k + "attn_norm"], ops[k + "qr_norm"], ops[k + "cache_icomp"], 67,
                                   NUMPY)
    np.testing.assert_array_equal(idx.selected, ops[k + "idx_selected"])
    np.testing.assert_array_equal(allowed.astype(np.int8), ops[k + "comp_allowed"])


# ---------------------------------------------------------------- attention

def test_mixed_attention_matches_ds4c(model, ops, positions):
    cfg, w = model
    worst_s = worst_h = 0.0
    for il in range(cfg.n_layer):
        for p in positions:
            k = f"L{il}.P{p}."
            comp = ops.get(k + "cache_comp", np.zeros((0, cfg.head_dim), np.float32))
            allowed = ops[k + "comp_allowed"].astype(bool) if k + "comp_allowed" in ops else None
            heads = attention_mixed(ops[k + "q_rope"], ops[k + "cache_raw"], comp, allowed, w.layers[il].attn_sinks, NUMPY)
            rows = np.concatenate([ops[k + "cache_raw"], comp])
            scores = attention_scores(ops[k + "q_rope"], rows, allowed, n_raw=len(ops[k + "cache_raw"]))
            worst_s = max(worst_s, rel(scores, ops[k + "attn_scores"]))
            worst_h = max(worst_h, rel(heads, ops[k + "heads"]))
    assert worst_s <= 1e-5 and worst_h <= 1e-5, (worst_s, worst_h)


def test_masked_compressed_rows_do_not_matter(model, ops):
    """Changing a row the indexer hid changes nothing; changing an allowed one does."""
    _, w = model
    k = "L2.P299."
    q, raw, comp = ops[k + "q_rope"], ops[k + "cache_raw"], ops[k + "cache_comp"].copy()
    allowed = ops[k + "comp_allowed"].astype(bool)
    base = attention_mixed(q, raw, comp, allowed, w.layers[2].attn_sinks, NUMPY)
    hidden, shown = np.flatnonzero(~allowed)[0], np.flatnonzero(allowed)[0]
    comp[hidden] *= 10
    np.testing.assert_array_equal(attention_mixed(q, raw, comp, allowed, w.layers[2].attn_sinks, NUMPY), base)
    comp[shown] *= 10
    assert not np.array_equal(attention_mixed(q, raw, comp, allowed, w.layers[2].attn_sinks, NUMPY), base)


# ---------------------------------------------------------------- the whole sub-layer

def test_layer_attention_one_chained_from_ds4c_state(model, ops, positions):
    """Whole sub-layer from ds4's hc_in and cache: float ops tight, roundings flip at most rarely, decisions equal."""
    cfg, w = model
    worst, n_sel = {}, 0
    for il in range(cfg.n_layer):
        for p in positions[1:]:
            k, rec = f"L{il}.P{p}.", {}
            cache = seeded_cache(cfg, ops, il, p)
            attention_one(cfg, w.layers[il], cache, ops[k + "hc_in"], p, trace=lambda n, v: rec.__setitem__(n, v))
            assert set(rec) <= {n[len(k):] for n in ops if n.startswith(k)}, set(rec) - set(ops)
            for n, v in rec.items():
                if n in ("idx_selected", "comp_allowed"):
                    np.testing.assert_array_equal(v, ops[k + n])
                    n_sel += n == "idx_selected"
                elif n == "kv_fp8":      # E4M3 part exact; RoPE dims float
                    n_nope = cfg.head_dim - cfg.n_rot
                    np.testing.assert_array_equal(v[:n_nope], ops[k + n][:n_nope])
                elif n == "kv_stored":   # a 1e-7 float difference may flip an F16 rounding by one ulp
                    ref = ops[k + n]
                    assert (np.abs(v - ref) <= np.spacing(np.abs(ref).astype(np.float16)).astype(np.float32)).all()
                else:
                    worst[n] = max(worst.get(n, 0.0), rel(v, ops[k + n]))
            assert cache.n_raw == len(ops[k + "cache_raw"])
            assert cache.n_comp == (len(ops[k + "cache_comp"]) if cfg.compress_ratio(il) else 0)
    assert n_sel == 16
    for n in ("attn_x", "attn_norm", "qr_norm", "q_normed", "kv_normed", "q_rope", "kv_rope", "comp_kv",
              "comp_pooled", "comp_row", "icomp_row", "idx_q_raw", "idx_scores"):
        assert worst[n] <= 1e-5, (n, worst[n])
    # downstream of F16 / int8 rounding flips of chained values: measured <= 1.1e-3
    for n in ("attn_scores", "heads", "attn_out", "after_attn_hc"):
        assert worst[n] <= 1e-2, (n, worst[n])


def test_decode_and_prefill_agree_bit_for_bit(model):
    """Layer 2 (ratio 4 + indexer) over 80 tokens: 20 emissions, indexer active from position 67."""
    cfg, w = model
    rng = np.random.default_rng(6)
    Xs = rng.standard_normal((80, cfg.n_hc, cfg.n_embd)).astype(np.float32)
    c1, c2, sel1, sel2 = LayerCache(cfg, 2, 1024), LayerCache(cfg, 2, 1024), {}, {}
    Y1 = np.stack([attention_one(cfg, w.layers[2], c1, Xs[t], t,
                                       trace=lambda n, v, t=t: sel1.__setitem__(t, v) if n == "idx_selected" else None)
                   for t in range(80)])
    Y2 = attention_batch(cfg, w.layers[2], c2, Xs, 0,
                               trace=lambda n, v: sel2.__setitem__(int(n[1:n.index(".")]), v)
                               if n.endswith(".idx_selected") else None)
    np.testing.assert_array_equal(Y1, Y2)
    for name in ("raw_rows", "comp_rows", "index_rows", "attn_state_kv", "attn_state_score", "index_state_kv"):
        np.testing.assert_array_equal(getattr(c1, name), getattr(c2, name))
    assert sorted(sel1) == list(range(67, 80)) and all(np.array_equal(sel1[t], sel2[t]) for t in sel1)
    assert all(len(v) == cfg.indexer_top_k for v in sel1.values())
    # replaying the recorded choices gives the same outputs (and a prefill split in two also agrees)
    force = np.full((80, cfg.indexer_top_k), -1, np.int32)
    for t, v in sel1.items():
        force[t] = v
    c3 = LayerCache(cfg, 2, 1024)
    Y3a = attention_batch(cfg, w.layers[2], c3, Xs[:50], 0, force_indexer=force[:50])
    Y3b = np.stack([attention_one(cfg, w.layers[2], c3, Xs[t], t, force_indexer=force[t]) for t in range(50, 80)])
    np.testing.assert_array_equal(np.concatenate([Y3a, Y3b]), Y1)


def test_dense_and_ratio128_layers_decode_equals_prefill(model):
    cfg, w = model
    rng = np.random.default_rng(1)
    Xs = rng.standard_normal((20, cfg.n_hc, cfg.n_embd)).astype(np.float32)
    for il in (0, 3):
        c1, c2 = LayerCache(cfg, il, 64), LayerCache(cfg, il, 64)
        Y1 = np.stack([attention_one(cfg, w.layers[il], c1, Xs[t], t) for t in range(20)])
        np.testing.assert_array_equal(attention_batch(cfg, w.layers[il], c2, Xs, 0), Y1)
        assert c1.n_raw == 20 and c1.n_comp == 0



def test_decode_attention_goes_through_the_backend(model, ops):
    """Every decoded (and prefilled) token's mixed attention is one be.attention call with the cache's rows;
    a backend's fused kernel (numba) gives ds4.c's heads and keeps decode == prefill."""
    from ds4ref.backend import NumpyBackend
    from ds4ref.backends import get_backend
    cfg, w = model

    class Spy(NumpyBackend):
        def __init__(self):
            self.calls = []

        def attention(self, q, raw_rows, comp_rows, sinks, allowed=None):
            self.calls.append((np.shape(q), len(raw_rows) + len(comp_rows), len(raw_rows),
                               None if allowed is None else int(np.sum(allowed))))
            return super().attention(q, raw_rows, comp_rows, sinks, allowed)

    rng = np.random.default_rng(3)
    Xs = rng.standard_normal((72, cfg.n_hc, cfg.n_embd)).astype(np.float32)
    spy, c1, c2 = Spy(), LayerCache(cfg, 2, 1024), LayerCache(cfg, 2, 1024)
    Y1 = np.stack([attention_one(cfg, w.layers[2], c1, Xs[t], t) for t in range(72)])
    Y2 = np.stack([attention_one(cfg, w.layers[2], c2, Xs[t], t, be=spy) for t in range(72)])
    np.testing.assert_array_equal(Y1, Y2)
    assert len(spy.calls) == 72 and all(c[0] == (cfg.n_head, cfg.head_dim) for c in spy.calls)
    assert Spy.implements == {"attention"}                                        # what it overrides
    assert spy.calls[0][1:] == (1, 1, None) and spy.calls[9][1:] == (12, 10, 2)   # 10 raw rows + 2 compressed, both visible
    assert spy.calls[71][1:] == (72 + 18, 72, cfg.indexer_top_k)                 # indexer on: top_k of 18 visible
    first = spy.calls[:5]
    spy.calls.clear()
    attention_batch(cfg, w.layers[2], LayerCache(cfg, 2, 1024), Xs[:5], 0, be=spy)
    assert spy.calls == first                                                    # token by token, as decode
    # numba's sink-attention kernel: ds4.c's heads on ops_A, and decode == prefill on the whole sub-layer
    nb = get_backend("numba")
    worst = 0.0
    for il in range(cfg.n_layer):
        for p in (4, 67, 299):
            k = f"L{il}.P{p}."
            comp = ops.get(k + "cache_comp", np.zeros((0, cfg.head_dim), np.float32))
            allowed = ops[k + "comp_allowed"].astype(bool) if k + "comp_allowed" in ops else None
            heads = attention_mixed(ops[k + "q_rope"], ops[k + "cache_raw"], comp, allowed, w.layers[il].attn_sinks, nb)
            worst = max(worst, rel(heads, ops[k + "heads"]))
    assert worst <= 1e-5, worst
    c3, c4 = LayerCache(cfg, 2, 1024), LayerCache(cfg, 2, 1024)
    Yn = np.stack([attention_one(cfg, w.layers[2], c3, Xs[t], t, be=nb) for t in range(72)])
    np.testing.assert_array_equal(attention_batch(cfg, w.layers[2], c4, Xs, 0, be=nb), Yn)
    assert rel(Yn, Y1) <= 1e-2, rel(Yn, Y1)      # float-order differences, amplified by F16/E4M3/int8 roundings (3e-3)


# ---------------------------------------------------------------- sizes, snapshots, errors

def test_kv_cache_bytes_formula_matches_a_live_cache(model):
    cfg, _ = model
    for ctx in (1, 100, 1024):
        assert KVCache(cfg, ctx).nbytes == kv_cache_bytes(cfg, ctx)["total"]
    real = ModelConfig.real()
    m = kv_cache_bytes(real, 2**20)
    assert m["raw"] == 43 * 128 * 512 * 4
    assert m["comp_ratio4"] == 21 * (2**18 + 2) * 512 * 4
    assert m["comp_ratio128"] == 20 * (2**13 + 2) * 512 * 4
    assert m["indexer"] == 21 * (2**18 + 2) * 128 * 4
    assert m["mha"] == 43 * 2**20 * 2 * 64 * 512 * 4
    assert 800 < m["mha"] / m["total"] < 830


def test_snapshot_is_independent(model):
    cfg, w = model
    cache = KVCache(cfg, 64)
    assert len(cache) == cfg.n_layer and cache[2].ratio == 4 and cache[3].ratio == 128 and cache[0].ratio == 0
    snap = cache.copy()
    X = np.ones((cfg.n_hc, cfg.n_embd), np.float32)
    for t in range(4):
        attention_one(cfg, w.layers[2], cache[2], X, t)
    assert (cache[2].n_raw, cache[2].n_comp, cache[2].n_index_comp) == (4, 1, 1)
    assert (snap[2].n_raw, snap[2].n_comp) == (0, 0) and (snap[2].attn_state_score == -1e30).all()


def test_bad_input_raises_named_errors(model):
    """Sizes are checked where they arrive: a cache's ctx_size when it is built, a forward call's positions against
    its cache (chapter 8's check_tokens: before anything is computed, so no compressed row overflows), recorded
    indexer rows when a session gets them (check_decisions)."""
    from ds4ref.model import Model, ModelError
    from ds4ref.trace import DecisionError, check_decisions
    cfg, w = model
    for bad in (0, -3, 2.5, True):
        with pytest.raises(KVCacheError):
            LayerCache(cfg, 0, bad)
    m, cache = Model(cfg, w, NUMPY), KVCache(cfg, 8)
    m(list(range(1, 9)), cache, 0)                  # 8 positions fill ctx 8: rows of positions 3 and 7
    assert (cache[2].n_comp, cache[2].comp_cap) == (2, 4)
    with pytest.raises(ModelError, match="do not fit a cache of ctx_size 8"):
        m([1], cache, 8)
    assert cache[2].n_raw == 8                      # unchanged
    rows = np.full((4, cfg.indexer_top_k), -1, np.int32)
    rows[3, 0] = 5                                  # one row exists at position 3; -1 beside an id
    with pytest.raises(DecisionError, match="position 3"):
        check_decisions(cfg, {"indexer": {2: rows}})
    with pytest.raises(CompressorError, match="lane kind"):
        CompressorLane("bogus", None, None, None, None, None, None)


def test_finish_prefill_states_changes_no_output(model):
    """ds4.c clears the open window's unwritten state rows after a prefill; later tokens are unaffected."""
    cfg, w = model
    rng = np.random.default_rng(2)
    Xs = rng.standard_normal((14, cfg.n_hc, cfg.n_embd)).astype(np.float32)
    for il in (2, 3):
        c1, c2 = LayerCache(cfg, il, 256), LayerCache(cfg, il, 256)
        attention_batch(cfg, w.layers[il], c1, Xs[:10], 0)
        attention_batch(cfg, w.layers[il], c2, Xs[:10], 0)
        c2.finish_prefill_states(10)
        r = cfg.compress_ratio(il)
        cleared = slice(r + 10 % r, 2 * r) if r == 4 else slice(10 % r, r)
        assert (c2.attn_state_score[cleared] == -1e30).all() and not (c2.attn_state_kv[cleared]).any()
        for t in range(10, 14):
            np.testing.assert_array_equal(attention_one(cfg, w.layers[il], c1, Xs[t], t),
                                          attention_one(cfg, w.layers[il], c2, Xs[t], t))
        np.testing.assert_array_equal(c1.comp_rows, c2.comp_rows)


def test_raw_window_is_the_last_cap_rows_of_any_push_sequence(model):
    """Property: after any number of pushes the window holds the last min(n_swa, ctx) rows, oldest first."""
    from hypothesis import given, settings, strategies as st
    cfg, _ = model

    @settings(max_examples=40, deadline=None)
    @given(ctx=st.integers(1, 300), n=st.integers(0, 400))
    def check(ctx, n):
        c = LayerCache(cfg, 0, ctx)
        rows = np.arange(n, dtype=np.float32)[:, None] * np.ones(cfg.head_dim, np.float32)   # exact in F16 up to 2048
        for r in rows:
            c.push_raw(r)
        want = rows[max(0, n - min(cfg.n_swa, ctx)):]
        assert c.n_raw == len(want) and c.cap_raw == min(cfg.n_swa, ctx)
        np.testing.assert_array_equal(c.raw_rows, want)

    check()

"""Chapter 03's backend contract: `project` dispatches on the weight's type, the routed experts run every
expert type ds4.c accepts (IQ2_XXS, Q2_K, Q4_K), and a strict backend refuses at open time a file whose
tensors it would hand to numpy. Independent formulas: gguf-py's dequantization and float64 products."""
from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest

from ds4ref.backend import NUMPY, UnimplementedOpError, quant_type, weight_op
from ds4ref.backends import get_backend
from ds4ref.config import ModelConfig
from ds4ref.engine import Engine
from ds4ref.ggml_types import GGMLType
from ds4ref.matvec import MatvecError, matvec_f16, matvec_f32, matvec_q8_0_prequant
from ds4ref.quant import F32, Q8_0, quantize_q8_0, quantize_q8_K
from ds4ref.dev.quantize import quantize
from ds4ref.weights import Tensor, load_model
from ds4ref.dev.writer import write_model

from _helpers import rel

MICRO = dataclasses.replace(
    ModelConfig.tiny(), n_layer=3, n_vocab=300, n_head=2, head_dim=192, value_dim=192, n_lora_q=32,
    n_lora_o=32, n_out_group=1, n_expert=8, n_expert_used=6, n_hash_layer=1, n_indexer_head=2,
    indexer_top_k=4, compress_ratios=(0, 0, 4), n_swa=8)


def _tensor(name, ggml_type, raw, n):
    """A 2-D Tensor over raw rows [rows, row_bytes] holding n values per row."""
    return Tensor(name, GGMLType(ggml_type), (n, raw.shape[0]), raw)


@pytest.fixture(scope="module")
def q4_model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("q4") / "q4k.gguf", MICRO, seed=3,
                       expert_types=("Q4_K", "Q4_K"))


@pytest.fixture(scope="module")
def q2_model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("q2") / "q2.gguf", MICRO, seed=3)


def test_project_dispatches_on_type():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((24, 64)).astype(np.float32)
    x = rng.standard_normal(64).astype(np.float32)
    f32 = _tensor("f32.weight", F32, w.view(np.uint8).reshape(24, -1), 64)
    # F32: one float64 sum per row, rounded once (ds4.c's matvec_f32)
    want = (w.astype(np.float64) @ x.astype(np.float64)).astype(np.float32)
    assert np.array_equal(NUMPY.project(f32, x), want)
    # Q8_0 with a float input quantizes it; with a Q8Act it is the prequant kernel
    q8w = _tensor("q8.weight", Q8_0, quantize(w, Q8_0), 64)
    a = quantize_q8_0(x)
    assert np.array_equal(NUMPY.project(q8w, x), matvec_q8_0_prequant(q8w, a))
    assert np.array_equal(NUMPY.project(q8w, a), matvec_q8_0_prequant(q8w, a))
    deq = gguf.quants.dequantize(q8w.data, gguf.GGMLQuantizationType.Q8_0).astype(np.float64)
    assert rel(NUMPY.project(q8w, x), deq @ x) < 2e-2            # Q8_0(x): about 1 % per value
    # numpy's row per type: the projected types' kernels are chapter 3's references
    assert [NUMPY.kernels[t].matvec for t in (F32, 1, Q8_0)] == [matvec_f32, matvec_f16,
                                                                  matvec_q8_0_prequant]
    assert quant_type(q8w).activation == "Q8_0" and quant_type(f32).activation == "float"


def test_project_refuses_what_it_cannot_run():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((4, 256)).astype(np.float32)
    q2 = _tensor("q2.weight", 10, quantize(w, 10), 256)
    with pytest.raises(MatvecError, match="'q2.weight' has type Q2_K"):
        NUMPY.project(q2, np.zeros(256, np.float32))
    f32 = _tensor("f32.weight", F32, w.view(np.uint8).reshape(4, -1), 256)
    with pytest.raises(MatvecError, match="Q8Act input"):
        NUMPY.project(f32, quantize_q8_0(np.zeros(256, np.float32)))


def test_weight_op_covers_every_tensor(q2_model, q4_model):
    for path, gate in ((q2_model, "matvec_iq2_xxs_q8_K"), (q4_model, "matvec_q4_K_q8_K")):
        g, cfg, w = load_model(path)
        ops = {t.name: weight_op(t) for t in w.tensors() if t is not None}
        g.close()
        assert ops["token_embd.weight"] is None and ops["output_norm.weight"] is None
        assert ops["output.weight"] == "project" and ops["blk.0.hc_attn_fn.weight"] == "project"
        assert ops["blk.2.attn_compressor_ape.weight"] is None and ops["blk.0.ffn_gate_tid2eid.weight"] is None
        assert ops["blk.1.ffn_gate_exps.weight"] == "experts_mid"
        assert ops["blk.1.ffn_down_exps.weight"] == "experts_down"
        assert NUMPY.kernels[quant_type(w.layers[1].ffn_gate_exps).id].matvec.__name__ == gate


def test_q4_K_experts_against_gguf_dequantization(q4_model):
    g, cfg, w = load_model(q4_model)
    lw = w.layers[1]
    rng = np.random.default_rng(2)
    x = rng.standard_normal(cfg.n_embd).astype(np.float32)
    ids, weights = np.array([5, 0, 7, 2, 3, 1]), rng.uniform(0.1, 1, 6).astype(np.float32)
    a = quantize_q8_K(x)
    xa = (a.qs.reshape(-1, 256) * a.d.reshape(-1, 1)).reshape(-1).astype(np.float64)  # Q8_K(x) in float
    a1 = type(a)(*(f[None] for f in a))                                                 # one token
    mid = NUMPY.experts_mid(lw.ffn_gate_exps, lw.ffn_up_exps, ids[None], weights[None], a1,
                            cfg.swiglu_clamp)[0]
    Q4 = gguf.GGMLQuantizationType.Q4_K
    for s, e in enumerate(ids):
        gd = gguf.quants.dequantize(lw.ffn_gate_exps.expert(int(e)).data, Q4).astype(np.float64)
        ud = gguf.quants.dequantize(lw.ffn_up_exps.expert(int(e)).data, Q4).astype(np.float64)
        gt, ut = np.minimum(gd @ xa, 10.0), np.clip(ud @ xa, -10.0, 10.0)
        want = gt / (1 + np.exp(-gt)) * ut * weights[s]
        assert rel(mid[s], want) < 1e-5
    midq = quantize_q8_K(mid)
    down = NUMPY.experts_down(lw.ffn_down_exps, ids[None], type(midq)(*(f[None] for f in midq)))[0]
    want = np.zeros(cfg.n_embd)
    for s, e in enumerate(ids):
        dd = gguf.quants.dequantize(lw.ffn_down_exps.expert(int(e)).data, Q4).astype(np.float64)
        ma = (midq.qs[s].reshape(-1, 256) * midq.d[s].reshape(-1, 1)).reshape(-1)
        want += dd @ ma
    assert rel(down, want) < 1e-5
    g.close()


def test_q4_K_model_runs_and_numba_falls_back(q4_model):
    """numba runs a Q4_K-expert model: its routed experts go to numpy's reference bit for
    bit, and with numpy's expert choices replayed the whole model meets the forced-decision
    bound against numpy (corr >= 0.995, max |d| <= 1). Not a tight rel bound on the
    logits: numba's F16 and attention sums differ from numpy's by ~2e-7, and an
    activation's Q8_0 rounding flipped by that moves the next projection by ~4e-3 (on an
    AVX2-only Zen 3, rel 1.9e-2); replaying the choices keeps a near-tie expert flip, a
    discrete jump of either run, out of a comparison of two float orders."""
    from ds4ref.trace import Trace
    g, cfg, w = load_model(q4_model)
    lw, nb = w.layers[1], get_backend("numba")
    rng = np.random.default_rng(4)
    a = quantize_q8_K(rng.standard_normal(cfg.n_embd).astype(np.float32))
    ids, weights = np.array([5, 0, 7, 2, 3, 1]), rng.uniform(0.1, 1, 6).astype(np.float32)
    a1 = type(a)(*(f[None] for f in a))                                # one token
    args = (lw.ffn_gate_exps, lw.ffn_up_exps, ids[None], weights[None], a1, cfg.swiglu_clamp)
    mid = nb.experts_mid(*args)
    assert np.array_equal(mid, NUMPY.experts_mid(*args))
    midq = quantize_q8_K(mid)
    assert np.array_equal(nb.experts_down(lw.ffn_down_exps, ids[None], midq),
                          NUMPY.experts_down(lw.ffn_down_exps, ids[None], midq))
    g.close()
    prompt = [1, 17, 42, 99, 7]
    runs, force = {}, None
    for name in ("numpy", "numba"):
        eng = Engine.open(q4_model, name)
        s = eng.session(ctx_size=32, force_decisions=force)
        s.trace = Trace(names=["exp_ids"])
        rows = []
        for t in prompt:                              # one token at a time: the decode path
            s.eval(t)
            rows.append(np.array(s.logits, np.float64))
        runs[name] = np.array(rows)
        force = {"experts": {il: s.trace.series("exp_ids", il)[1] for il in range(cfg.n_layer)}}
    assert np.isfinite(runs["numpy"]).all() and runs["numpy"].std() > 0
    for ours, ref in zip(runs["numba"], runs["numpy"]):
        assert np.corrcoef(ours, ref)[0, 1] >= 0.995          # the forced-decision bound
        assert np.abs(ours - ref).max() <= 1.0


def test_strict_backend_refuses_at_open(q2_model, q4_model):
    strict = get_backend("numba", strict=True)
    with pytest.raises(UnimplementedOpError,
                       match=r"experts_mid for tensor 'blk.0.ffn_gate_exps.weight' \(Q4_K\)"):
        Engine.open(q4_model, strict)
    eng = Engine.open(q2_model, strict)               # the q2 type mix runs in numba's own kernels
    assert eng.backend.is_strict
    NUMPY.check_weights(load_model(q4_model)[2])      # numpy runs every type: nothing to refuse


def test_resident_mlx_refuses_q4_K_experts(q4_model):
    pytest.importorskip("mlx.core")
    from ds4ref.backends.mlx_backend import MlxBackend
    with pytest.raises(UnimplementedOpError, match=r"'mlx' \(strict\): experts_mid .*Q4_K"):
        Engine.open(q4_model, MlxBackend(device="cpu"), resident=True, ctx_size=32)

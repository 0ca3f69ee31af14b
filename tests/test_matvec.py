"""Chapter 03: quantized matvecs against ds4.c's recorded ops, an independent formula, and each other."""
from __future__ import annotations

import tracemalloc

import gguf.quants
import numpy as np
import pytest

from ds4ref.backend import (COMPOSED, GLUE, KERNELS, KERNELS_BY_TYPE, NUMPY, SEAM, TYPE_KERNELS, BackendError,
                            NumpyBackend, TypeKernels, UnimplementedOpError, coverage)
from ds4ref.backends import get_backend
from ds4ref.backends.numba.backend import NumbaBackend
from ds4ref.matvec import MatvecError, matvec_f16, matvec_q8_0, matvec_q8_0_prequant
from ds4ref.quant import TYPES, Q8Act, Q8KAct, QuantError, quantize_q8_0, quantize_q8_K
from ds4ref.dev.quantize import quantize

from _helpers import q8, q8k, rel

NUMBA = get_backend("numba", strict=True)     # chapter 09's one numba class, built from chapter 03's functions
BACKENDS = [NUMPY, NUMBA]
TYPE_ID = {"F16": 1, "Q8_0": 8, "Q2_K": 10, "Q4_K": 12, "IQ2_XXS": 16}


def layer_keys(ops):
    for p in ops["positions"]:
        for il in range(6):
            yield il, f"L{il}.P{p}."


# --- ds4.c oracle: fed ds4's own int8 activations, every matvec reproduces ds4's recorded output ---------

@pytest.mark.parametrize("be", BACKENDS, ids=lambda b: b.name)
def test_q8_0_matvecs_reproduce_ds4c_bit_for_bit(be, model, ops_A):
    """qr, q_b, kv_raw, attn_low (grouped), attn_out, shared gate/up/out, logits: all 17 positions x 6 layers."""
    cfg, w = model
    n_checked = 0
    for il, k in layer_keys(ops_A):
        lw = w.layers[il]
        cases = [
            (lw.attn_q_a, "q8.attn_q_a", "qr"),
            (lw.attn_q_b, "q8.attn_q_b", "q_b"),
            (lw.attn_kv, "q8.attn_kv", "kv_raw"),
            (lw.attn_output_b, "q8.attn_output_b", "attn_out"),
            (lw.ffn_gate_shexp, "q8.ffn_gate_shexp", "shared_gate"),
            (lw.ffn_up_shexp, "q8.ffn_gate_shexp", "shared_up"),   # gate and up share one quantized input
            (lw.ffn_down_shexp, "q8.ffn_down_shexp", "shared_out"),
        ]
        for wt, act, out in cases:
            got = be.matvec_q8_0_prequant(wt, q8(ops_A, k + act))
            want = ops_A[k + out]
            assert got.dtype == np.float32
            assert np.array_equal(got, want.reshape(-1)), (k + out, rel(got, want.reshape(-1)))
            n_checked += 1
        # grouped output projection: group g uses rows g*n_lora_o.. on the q8 input of its heads
        a = q8(ops_A, k + "q8.attn_output_a")
        G, rank = cfg.n_out_group, cfg.n_lora_o
        n_in = a.qs.size // G
        low = np.stack([be.matvec_q8_0_prequant(lw.attn_output_a.data[g * rank:(g + 1) * rank],
                                                Q8Act(a.qs[g * n_in:(g + 1) * n_in], a.d[g * n_in // 32:(g + 1) * n_in // 32]))
                        for g in range(G)])
        assert np.array_equal(low, ops_A[k + "attn_low"]), k + "attn_low"
    for p in ops_A["positions"]:
        got = be.matvec_q8_0_prequant(w.output, q8(ops_A, f"P{p}.q8.output"))
        assert np.array_equal(got, ops_A[f"P{p}.logits"])
    assert n_checked == 7 * 6 * len(ops_A["positions"])


@pytest.mark.parametrize("be", BACKENDS, ids=lambda b: b.name)
def test_routed_expert_matvecs_reproduce_ds4c(be, model, ops_A):
    """IQ2_XXS gate/up pair on the shared Q8_K input -> exp_gate/exp_up (bit for bit); Q2_K -> exp_down (1e-5)."""
    _, w = model
    worst_down = 0.0
    for il, k in layer_keys(ops_A):
        lw = w.layers[il]
        a = q8k(ops_A, k + "q8k.ffn_gate_up_exps")
        for slot, e in enumerate(ops_A[k + "exp_ids"]):
            g, u = be.matvec_iq2_xxs_pair_q8_K(lw.ffn_gate_exps.expert(int(e)), lw.ffn_up_exps.expert(int(e)), a)
            assert np.array_equal(g, ops_A[k + "exp_gate"][slot]), (k, slot)
            assert np.array_equal(u, ops_A[k + "exp_up"][slot]), (k, slot)
            # the 3-D tensor's rows e*out..(e+1)*out are the same expert
            n_out = lw.ffn_down_exps.shape[1]
            rows = lw.ffn_down_exps.data[int(e) * n_out:(int(e) + 1) * n_out]
            d = be.matvec_q2_K_q8_K(rows, q8k(ops_A, k + "q8k.ffn_down_exps", slot))
            worst_down = max(worst_down, rel(d, ops_A[k + "exp_down"][slot]))
    assert worst_down <= 1e-5
    assert worst_down > 0        # measured 3.2e-7: ds4's compiled code orders the two float products differently


@pytest.mark.parametrize("be", BACKENDS, ids=lambda b: b.name)
def test_f16_matvecs_reproduce_ds4c_router_and_compressor(be, model, ops_A):
    """F16 on the float (not quantized) input: router_logits from ffn_norm, comp_kv from attn_norm."""
    _, w = model
    worst = {"router_logits": 0.0, "comp_kv": 0.0}
    for il, k in layer_keys(ops_A):
        lw = w.layers[il]
        worst["router_logits"] = max(worst["router_logits"],
                                     rel(be.matvec_f16(lw.ffn_gate_inp, ops_A[k + "ffn_norm"]), ops_A[k + "router_logits"]))
        if lw.attn_compressor_kv is not None:
            worst["comp_kv"] = max(worst["comp_kv"],
                                   rel(be.matvec_f16(lw.attn_compressor_kv, ops_A[k + "attn_norm"]), ops_A[k + "comp_kv"]))
    assert all(0 < v <= 1e-5 for v in worst.values()), worst


def test_quantize_then_matvec_equals_ds4c_path(model, ops_A):
    """matvec_q8_0 (quantize inside) on ds4's float attn_norm gives ds4's qr exactly: quantizer and dot chained."""
    _, w = model
    k = "L3.P64."
    assert np.array_equal(matvec_q8_0(w.layers[3].attn_q_a, ops_A[k + "attn_norm"]), ops_A[k + "qr"])
    assert np.array_equal(NUMBA.matvec_q8_0(w.layers[3].attn_q_a, ops_A[k + "attn_norm"]), ops_A[k + "qr"])


# --- independent formula: dequantize with the gguf package, then a float64 dot --------------------------

def gguf_dequant(raw: np.ndarray, name: str) -> np.ndarray:
    return gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, name)).astype(np.float64)


def q8k_values(a: Q8KAct) -> np.ndarray:
    return (a.qs.reshape(-1, 256) * a.d.reshape(-1, 1).astype(np.float64)).reshape(a.qs.shape)


@pytest.mark.parametrize("kind", ["Q8_0", "Q2_K", "Q4_K", "IQ2_XXS"])
@pytest.mark.parametrize("be", BACKENDS, ids=lambda b: b.name)
def test_integer_path_equals_dequantize_then_float64_dot(be, kind):
    """The int8 dots with float scales are the same sum as dequantized weights . dequantized activation."""
    rng = np.random.default_rng(TYPE_ID[kind])
    rows, n = 96, 1024
    x = rng.standard_normal((2, n)).astype(np.float32)
    raw = quantize(rng.standard_normal((rows, n)).astype(np.float32) * 0.05, TYPE_ID[kind])
    W = gguf_dequant(raw, kind)
    if kind == "Q8_0":
        a = quantize_q8_0(x)
        got = be.matvec_q8_0_prequant(raw, a)
        xv = (a.qs.reshape(2, -1, 32) * a.d[..., None].astype(np.float64)).reshape(2, n)
    else:
        a = quantize_q8_K(x)
        xv = q8k_values(a)
        if kind == "Q2_K":
            got = be.matvec_q2_K_q8_K(raw, a)
        elif kind == "Q4_K":
            got = be.matvec_q4_K_q8_K(raw, a)
        else:
            got = be.matvec_iq2_xxs_q8_K(raw, a)
    want = xv @ W.T                                     # [2, rows] float64
    assert got.shape == (2, rows) and got.dtype == np.float32
    assert rel(got, want) < 2e-6, rel(got, want)


def test_f16_matvec_equals_float64_dot():
    rng = np.random.default_rng(5)
    w = rng.standard_normal((64, 4096)).astype(np.float16)
    x = rng.standard_normal(4096).astype(np.float32)
    want = w.astype(np.float64) @ x
    for be in BACKENDS:
        assert rel(be.matvec_f16(w.view(np.uint8), x), want) < 1e-6


# --- the float32 fast path == an independent int64 computation ------------------------------------------

def saturated_rows(rng, kind: str, rows: int, n: int) -> np.ndarray:
    """Random valid blocks, 80% of the bytes at the largest code (Q8_0: -128; else 0xFF: Q2_K q=3, sc=m=15)."""
    raw = random_rows(rng, kind, rows, n)
    scale_at = {"Q8_0": [0], "Q2_K": [80, 82], "IQ2_XXS": [0]}[kind]
    size = {"Q8_0": 34, "Q2_K": 84, "IQ2_XXS": 66}[kind]
    blocks = raw.reshape(rows, -1, size)
    keep = np.zeros(size, bool)
    for o in scale_at:
        keep[o:o + 2] = True                               # leave the (finite) f16 scales alone
    extreme = np.uint8(0x80 if kind == "Q8_0" else 0xFF)
    blocks[...] = np.where(~keep & (rng.random(blocks.shape) < 0.8), extreme, blocks)
    return raw


def extreme_int8(rng, shape) -> np.ndarray:
    """int8 activations, 80% of them -128."""
    return np.where(rng.random(shape) < 0.8, np.int8(-128), rng.integers(-128, 128, shape, dtype=np.int8))


def f16_at(blocks: np.ndarray, offset: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[..., offset:offset + 2]).view("<f2")[..., 0].astype(np.float32)


def blockwise_float32(terms: list) -> np.ndarray:
    """ds4.c's outer loop: acc += term_b in float32, b = 0, 1, ..."""
    acc = np.zeros_like(terms[0])
    for t in terms:
        acc += t
    return acc


@pytest.mark.parametrize("kind", ["Q8_0", "Q2_K", "IQ2_XXS"])
@pytest.mark.parametrize("draw", ["random", "saturated"])
def test_float32_block_dots_equal_int64_reference(kind, draw):
    """The numpy matvecs compute the block dots through float32 matmuls: exact because every partial sum is an
    integer < 2^24. Against int64 dots (IQ2_XXS: from the unsigned grid and the sign table, not the signed
    table) with the same float32 outer loop, the results are bit-identical, at the largest codes too."""
    from ds4ref.matvec import matvec_iq2_xxs_q8_K, matvec_q2_K_q8_K
    from ds4ref.quant import unpack_iq2_xxs, unpack_q2_K

    rng = np.random.default_rng(2024 + len(kind) + len(draw))
    rows, n, T = 67, 1024, 3
    raw = (random_rows if draw == "random" else saturated_rows)(rng, kind, rows, n)
    qs = rng.integers(-128, 128, (T, n), dtype=np.int8) if draw == "random" else extreme_int8(rng, (T, n))
    if kind == "Q8_0":
        xd = rng.uniform(0.001, 0.1, (T, n // 32)).astype(np.float32)
        got = matvec_q8_0_prequant(raw, Q8Act(qs, xd))
        blocks = raw.reshape(rows, -1, 34)
        wq = blocks[:, :, 2:].view(np.int8).astype(np.int64)
        dots = np.einsum("rbi,tbi->trb", wq, qs.reshape(T, -1, 32).astype(np.int64))   # int64 [T, r, nb]
        wd = f16_at(blocks, 0)
        want = blockwise_float32([(wd[:, b] * xd[:, b, None]) * dots[..., b].astype(np.float32)
                                  for b in range(n // 32)])
        biggest = np.abs(dots).max()
    else:
        yd = rng.uniform(-0.1, -0.001, (T, n // 256)).astype(np.float32)
        bsums = qs.reshape(T, -1, 16).sum(-1, dtype=np.int64).astype(np.int16)
        a = Q8KAct(qs, yd, bsums)
        y = qs.reshape(T, -1, 256).astype(np.int64)
        if kind == "Q2_K":
            got = matvec_q2_K_q8_K(raw, a)
            sc, m, q, d, dmin = unpack_q2_K(raw)
            isum = np.einsum("rbg,rbgi,tbgi->trb", sc.astype(np.int64), q.reshape(rows, -1, 16, 16).astype(np.int64),
                             y.reshape(T, -1, 16, 16))
            summs = np.einsum("rbg,tbg->trb", m.astype(np.int64), bsums.reshape(T, -1, 16).astype(np.int64))
            want = blockwise_float32([(yd[:, b, None] * d[:, b]) * isum[..., b].astype(np.float32)
                                      - (yd[:, b, None] * dmin[:, b]) * summs[..., b].astype(np.float32)
                                      for b in range(n // 256)])
            biggest = np.abs(isum).max()
        else:
            got = matvec_iq2_xxs_q8_K(raw, a)
            d, grid, signs, scales = unpack_iq2_xxs(raw)
            vals = (grid.astype(np.int64) * signs).reshape(rows, -1, 8, 32)
            sumi = np.einsum("rbgi,tbgi->trbg", vals, y.reshape(T, -1, 8, 32))
            bsum = (sumi * (2 * scales.astype(np.int64) + 1)).sum(-1)                  # int64 [T, r, nb]
            want = np.float32(0.125) * blockwise_float32([(d[:, b] * yd[:, b, None]) * bsum[..., b].astype(np.float32)
                                                          for b in range(n // 256)])
            biggest = np.abs(bsum).max()          # the scaled block sum, which passes 2^24: int32 needed there
    assert got.shape == (T, rows) and got.dtype == np.float32
    assert np.array_equal(got, want)
    if draw == "saturated":              # the bounds are really exercised
        assert biggest > {"Q8_0": 2 ** 18, "Q2_K": 2 ** 19, "IQ2_XXS": 2 ** 24}[kind], biggest


def test_numpy_matvecs_take_an_empty_batch():
    """A batch of 0 activations gives [0, rows], not a reshape error."""
    from ds4ref.matvec import matvec_iq2_xxs_q8_K, matvec_q2_K_q8_K, matvec_q4_K_q8_K
    rng = np.random.default_rng(9)
    qs = np.zeros((0, 512), np.int8)
    q8_0 = Q8Act(qs, np.zeros((0, 16), np.float32))
    k = Q8KAct(qs, np.zeros((0, 2), np.float32), np.zeros((0, 32), np.int16))
    assert matvec_q8_0_prequant(random_rows(rng, "Q8_0", 5, 512), q8_0).shape == (0, 5)
    assert matvec_q2_K_q8_K(random_rows(rng, "Q2_K", 5, 512), k).shape == (0, 5)
    assert matvec_q4_K_q8_K(random_rows(rng, "Q4_K", 5, 512), k).shape == (0, 5)
    assert matvec_iq2_xxs_q8_K(random_rows(rng, "IQ2_XXS", 5, 512), k).shape == (0, 5)


# --- numba == numpy on random inputs -------------------------------------------------------------------

def random_rows(rng, kind: str, rows: int, n: int) -> np.ndarray:
    """Random bytes of valid blocks: any bit pattern is valid except that f16 scales must be finite."""
    per, size, scale_at = {"Q8_0": (32, 34, [0]), "Q2_K": (256, 84, [80, 82]),
                           "Q4_K": (256, 144, [0, 2]), "IQ2_XXS": (256, 66, [0])}[kind]
    raw = rng.integers(0, 256, (rows, n // per * size), dtype=np.uint8)
    blocks = raw.reshape(rows, -1, size)
    for o in scale_at:
        s = rng.uniform(-0.02, 0.02, blocks.shape[:2]).astype(np.float16)
        blocks[:, :, o:o + 2] = s[..., None].view(np.uint8)
    return raw


@pytest.mark.parametrize("kind", ["Q8_0", "Q2_K", "Q4_K", "IQ2_XXS"])
@pytest.mark.parametrize("n_tok", [1, 5])
def test_numba_equals_numpy_on_random_blocks(kind, n_tok):
    """Same int32 inner sums and the same float32 order: the results are identical, not just close."""
    rng = np.random.default_rng(100 + n_tok)
    n = 2048
    raw = random_rows(rng, kind, 203, n)
    x = (rng.standard_normal((n_tok, n)) * rng.uniform(0.1, 10)).astype(np.float32)
    if kind == "Q8_0":
        a = quantize_q8_0(x)
        pairs = [(NUMPY.matvec_q8_0_prequant(raw, a), NUMBA.matvec_q8_0_prequant(raw, a))]
    elif kind == "IQ2_XXS":
        a = quantize_q8_K(x)
        up = random_rows(rng, kind, 203, n)
        pairs = list(zip(NUMPY.matvec_iq2_xxs_pair_q8_K(raw, up, a), NUMBA.matvec_iq2_xxs_pair_q8_K(raw, up, a)))
    else:
        a = quantize_q8_K(x)
        f = "matvec_q2_K_q8_K" if kind == "Q2_K" else "matvec_q4_K_q8_K"
        pairs = [(getattr(NUMPY, f)(raw, a), getattr(NUMBA, f)(raw, a))]
    for ref, got in pairs:
        assert got.shape == ref.shape == (n_tok, 203)
        assert np.array_equal(got, ref)


def test_numba_f16_agrees_with_numpy_to_1e6():
    rng = np.random.default_rng(7)
    w = rng.standard_normal((300, 4096)).astype(np.float16).view(np.uint8)
    x = rng.standard_normal((3, 4096)).astype(np.float32)
    assert rel(NUMBA.matvec_f16(w, x), NUMPY.matvec_f16(w, x)) <= 1e-6


def test_numba_f16_to_f32_is_exact_on_every_bit_pattern():
    """The kernel's in-register f16 conversion equals numpy's on all 65536 patterns (subnormals, inf, NaN payloads)."""
    from numba import njit

    from ds4ref.backends.numba.f16 import f16_to_f32

    @njit
    def convert_all(h, out):
        for i in range(h.shape[0]):
            out[i] = f16_to_f32(h[i])

    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    got = np.empty(1 << 16, np.float32)
    convert_all(h, got)
    assert np.array_equal(got.view(np.uint32), h.view(np.float16).astype(np.float32).view(np.uint32))


def test_numba_f16_matvec_reads_subnormal_and_huge_weights_exactly():
    """Weights at the ends of the f16 range (subnormals, 65504) against a one-hot x: each output is one weight."""
    w16 = np.array([[1, 0x03ff, 0x7bff, 0x8001], [0xfbff, 0x0400, 0x3c00, 0x8000]], np.uint16)
    want = w16.view(np.float16).astype(np.float32)
    for i in range(4):
        x = np.zeros(4, np.float32)
        x[i] = 1.0
        assert np.array_equal(NUMBA.matvec_f16(w16.view(np.uint8), x), want[:, i])


def test_batched_activations_equal_one_token_at_a_time(model, ops_A):
    _, w = model
    x = np.stack([ops_A[f"L1.P{p}.attn_norm"] for p in (1, 2, 64)])       # [3, 256]
    for be in BACKENDS:
        batch = be.matvec_q8_0(w.layers[1].attn_kv, x)
        assert batch.shape == (3, 256)
        for t in range(3):
            assert np.array_equal(batch[t], be.matvec_q8_0(w.layers[1].attn_kv, x[t]))


def test_backends_share_one_interface():
    assert NUMPY.name == "numpy" and NUMBA.name == "numba"
    assert isinstance(NUMBA, NumbaBackend) and issubclass(NumbaBackend, NumpyBackend)
    for op in KERNELS + GLUE + TYPE_KERNELS:
        assert callable(getattr(NUMPY, op)) and callable(getattr(NUMBA, op))


def test_the_contract_names_what_the_model_calls():
    """The seam is declared once (SEAM: kernels, glue, placement) and the type kernels are named per weight type
    (KERNELS_BY_TYPE): every `be.<name>` in the model's modules is a member of SEAM, a composition numpy builds from them, or what
    the engine asks of a backend when it opens a file; each of KERNELS is called."""
    import re
    from pathlib import Path
    import ds4ref
    called = set()
    for path in Path(ds4ref.__file__).parent.glob("*.py"):
        if path.name not in ("backend.py",):
            called |= set(re.findall(r"\bbe\.(\w+)\b", path.read_text()))
    seam = {m for group in SEAM.values() for m in group}
    engine = {"check_weights", "strict", "on_device", "implements", "partial", "is_strict", "name", "batch_is_decode"}
    composed = {"expert_pair", "expert_matvec", "matvec_q8_0"}
    assert set(SEAM) == {"kernels", "glue", "placement"} and SEAM["kernels"] == KERNELS and SEAM["glue"] == GLUE
    assert set(KERNELS) <= called
    assert called - engine - composed <= seam, called - engine - composed - seam
    assert set(TYPE_KERNELS) == {k for ks in KERNELS_BY_TYPE.values() for k in ks}
    assert set(KERNELS_BY_TYPE) == {t for t, q in TYPES.items() if q.activation}
    for t, ks in KERNELS_BY_TYPE.items():       # each backend's row: its own methods
        assert NUMBA.kernels[t] == TypeKernels(*(getattr(NUMBA, k) for k in ks))
    assert not set(KERNELS) & set(GLUE) and not set(KERNELS) & set(TYPE_KERNELS)
    assert coverage(NUMPY) == {op: "own" for op in KERNELS + TYPE_KERNELS}


class SeamSpy:
    """A backend that records every attribute the model reads on it, and hands it the real one."""
    def __init__(self, be):
        self.__dict__["_be"], self.__dict__["seen"] = be, set()

    def __getattr__(self, name):
        self.seen.add(name)
        return getattr(self._be, name)


@pytest.mark.parametrize("be", BACKENDS, ids=lambda b: b.name)
def test_a_forward_pass_reads_nothing_of_its_backend_outside_the_seam(be, model, golden_A):
    """Build chapter 8's model on a spy of the backend and run a traced prefill with ds4.c's decisions replayed
    (past the indexer's threshold at position 67) and a decode step: the model reads only SEAM's members, and
    every kernel and glue op among them."""
    from ds4ref.dev.oracle import decisions_from_golden
    from ds4ref.kvcache import KVCache
    from ds4ref.model import Model
    from ds4ref.trace import Hooks, Trace
    cfg, w = model
    spy = SeamSpy(be)
    m, cache = Model(cfg, w, spy), KVCache(cfg, 128)
    prompt = [int(t) for t in golden_A["prompt_ids"][:80]]
    hooks = Hooks(Trace(positions=[70, 79]), decisions_from_golden(golden_A, cfg, "batch"))
    m.prefill(prompt, cache, hooks=hooks)
    m([int(golden_A["greedy_tokens"][0])], cache, 80)
    seam = {name for group in SEAM.values() for name in group}
    assert spy.seen <= seam, sorted(spy.seen - seam)
    # every glue op too: a layer that calls a module's function instead bypasses the backend's own
    assert set(KERNELS) | set(GLUE) <= spy.seen, sorted((set(KERNELS) | set(GLUE)) - spy.seen)
    assert {"place_layer", "upload", "download", "evaluate"} <= spy.seen
    assert len(hooks.trace.data) > 100


def test_strict_mode_refuses_what_a_backend_does_not_run_itself(model):
    class Half(NumpyBackend):
        name = "half"
        matvec_f16 = staticmethod(NUMPY.matvec_f16)
    _, w = model
    lw = w.layers[0]
    x = np.ones(lw.ffn_gate_inp.shape[0], np.float32)
    loose, strict = Half(), Half().strict()
    assert Half.implements == {"matvec_f16"}                    # what it overrides
    assert np.array_equal(strict.matvec_f16(lw.ffn_gate_inp, x), loose.matvec_f16(lw.ffn_gate_inp, x))
    assert loose.matvec_q8_0(lw.attn_kv, np.ones(256, np.float32)).shape == (256,)   # numpy, silently
    for op, call in [("matvec_q8_0_prequant", lambda b: b.matvec_q8_0_prequant(lw.attn_kv, quantize_q8_0(x[:256]))),
                     ("project", lambda b: b.project(lw.attn_kv, x[:256]))]:   # composed of it
        with pytest.raises(UnimplementedOpError, match=f"'half' \\(strict\\): {op} "):
            call(strict)
    assert issubclass(UnimplementedOpError, BackendError) and issubclass(UnimplementedOpError, NotImplementedError)
    assert coverage(Half)["matvec_f16"] == "own" and coverage(Half)["project"] == "numpy"
    assert coverage(NUMBA)["project"] == "composed" and coverage(NUMBA)["attention"] == "own"


def test_a_backend_cannot_declare_a_partial_case_of_what_it_does_not_run():
    with pytest.raises(BackendError, match="partial names"):
        class Liar(NumpyBackend):          # hands a case of attention to numpy, but never runs attention
            partial = {"attention": "a batch"}


def test_numba_decode_matvec_allocates_only_its_output():
    """A 4096 -> 1024 Q8_0 decode matvec allocates its 4 KB output, not a weight-sized temporary (numpy-side
    allocations, which tracemalloc sees; a copy of the weight or of the activation would show here)."""
    rng = np.random.default_rng(3)
    raw = random_rows(rng, "Q8_0", 1024, 4096)
    a = quantize_q8_0(rng.standard_normal(4096).astype(np.float32))
    NUMBA.matvec_q8_0_prequant(raw, a)                 # compile / load from cache first
    tracemalloc.start()
    NUMBA.matvec_q8_0_prequant(raw, a)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 64 * 1024, peak


# --- bad input -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("be", BACKENDS, ids=lambda b: b.name)
def test_bad_input_raises_named_errors(be, model):
    _, w = model
    lw = w.layers[0]
    a = quantize_q8_0(np.ones(256, np.float32))
    with pytest.raises(MatvecError, match="expected type Q8_0, got F16"):
        be.matvec_q8_0_prequant(lw.ffn_gate_inp, a)
    with pytest.raises(MatvecError, match="not a whole number of Q8_0 blocks"):
        be.matvec_q8_0_prequant(lw.attn_kv.data[:, :-1], a)
    with pytest.raises(MatvecError, match="must be uint8"):
        be.matvec_q8_0_prequant(lw.attn_kv.data.view(np.int8), a)
    with pytest.raises(MatvecError, match="has 64 values per row, the weight rows have 256"):
        be.matvec_q8_0_prequant(lw.attn_kv, quantize_q8_0(np.ones(64, np.float32)))
    with pytest.raises(MatvecError, match=r"\.d must have shape"):
        be.matvec_q8_0_prequant(lw.attn_kv, Q8Act(a.qs, a.d[:4]))
    with pytest.raises(MatvecError, match="qs must be int8"):
        be.matvec_q8_0_prequant(lw.attn_kv, Q8Act(a.qs.astype(np.int16), a.d))
    with pytest.raises(MatvecError, match="F16 matvec: x has shape"):
        be.matvec_f16(lw.ffn_gate_inp, np.ones(255, np.float32))
    k = quantize_q8_K(np.ones(256, np.float32))
    with pytest.raises(MatvecError, match="bsums must have shape"):
        be.matvec_q2_K_q8_K(lw.ffn_down_exps.expert(0), Q8KAct(k.qs, k.d, k.bsums[:8]))
    with pytest.raises(MatvecError, match="IQ2_XXS pair: gate"):
        be.matvec_iq2_xxs_pair_q8_K(lw.ffn_gate_exps.expert(0), lw.ffn_up_exps.data[:10], k)
    with pytest.raises(MatvecError, match="expected type Q2_K, got IQ2_XXS"):
        be.matvec_q2_K_q8_K(lw.ffn_gate_exps.expert(0), k)
    with pytest.raises(MatvecError, match="needs fields qs and d"):
        be.matvec_q8_0_prequant(lw.attn_kv, np.ones(256, np.float32))
    with pytest.raises(MatvecError, match="needs fields qs, d and bsums"):
        be.matvec_q2_K_q8_K(lw.ffn_down_exps.expert(0), quantize_q8_0(np.ones(256, np.float32)))
    with pytest.raises(QuantError, match="NaN"):        # the quantizer refuses non-finite activations
        be.matvec_q8_0(lw.attn_kv, np.full(256, np.nan, np.float32))


@pytest.mark.parametrize("be", BACKENDS, ids=lambda b: b.name)
def test_non_finite_values_propagate_as_documented(be, model):
    """Not errors: a NaN in an F16 input gives NaN rows (as ds4.c's float sum), a NaN weight scale a NaN row."""
    _, w = model
    x = np.ones(256, np.float32)
    x[7] = np.nan
    assert np.isnan(be.matvec_f16(w.layers[0].ffn_gate_inp, x)).all()
    raw = w.layers[0].attn_kv.data.copy()
    raw[5, 0:2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)      # row 5, block 0 scale
    y = be.matvec_q8_0_prequant(raw, quantize_q8_0(np.ones(256, np.float32)))
    assert np.isnan(y[5]) and np.isfinite(np.delete(y, 5)).all()


def test_numba_glue_gives_chapter_2s_bits_and_errors():
    """The numba backend's activation quantizers (host glue, appendix D.11) against chapter 2's on random batches
    with zero blocks, ties, a negative largest element and a float32 factor that overflows; the same QuantError
    on NaN / inf and on a Q8_K length that is not a multiple of 256; a Q8_0 length not a multiple of 32 padded as
    chapter 2 pads it."""
    from ds4ref.quant import QuantError, quantize_q8_0, quantize_q8_K
    rng = np.random.default_rng(41)
    x = rng.standard_normal((2, 3, 512)).astype(np.float32)
    x[0, 0, :256] = 0.0
    x[0, 1, 5] = -9.0
    x[1, 0, :32] = np.arange(32) - 15.5
    x[1, 0, 31] = 127.0
    x[1, 2, 256:] *= np.float32(1e-39)
    for got, want in ((NUMBA.quantize_q8_0(x), quantize_q8_0(x)), (NUMBA.quantize_q8_K(x), quantize_q8_K(x)),
                      (NUMBA.quantize_q8_0(x[0, 0, :100]), quantize_q8_0(x[0, 0, :100]))):
        assert type(got) is type(want)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape and np.array_equal(g, w)
    assert (quantize_q8_0(x).qs[1, 0, :31] == np.rint(np.arange(32) - 15.5)[:31]).all()  # the ties, to even
    bad = x.copy()
    bad[1, 1, 7] = np.nan
    for f in (NUMBA.quantize_q8_0, NUMBA.quantize_q8_K):
        with pytest.raises(QuantError, match="1 NaN/inf value"):
            f(bad)
    with pytest.raises(QuantError, match="not a multiple of 256"):
        NUMBA.quantize_q8_K(x[..., :300])
    assert NUMBA.quantize_q8_0 is not NUMPY.quantize_q8_0 and "quantize_q8_0" in GLUE

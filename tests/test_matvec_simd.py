"""Chapter 03, the Q2_K byte-dot kernels (numba intrinsics on x86 SIMD): the same bits as q2_K_kernel, and the
fallback to q2_K_kernel where the CPU lacks the instructions."""
from __future__ import annotations

import numpy as np
import pytest
from llvmlite import binding as llvm

import ds4ref.backends.numba.iq2_xxs as iq2
import ds4ref.backends.numba.iq2_xxs.avx2 as iq2a
import ds4ref.backends.numba.iq2_xxs.portable as iq2p
import ds4ref.backends.numba.isa as isa
import ds4ref.backends.numba.q2_k as q2
import ds4ref.backends.numba.q2_k.portable as q2p
import ds4ref.backends.numba.q2_k.simd as q2s
import ds4ref.backends.numba.q8_0 as q8
import ds4ref.backends.numba.q8_0.portable as q8p
import ds4ref.backends.numba.q8_0.vnni as nv
from ds4ref.backend import NUMPY
from ds4ref.backends import get_backend
from ds4ref.matvec import weight_rows
from ds4ref.quant import Q2_K, Q8KAct, quantize_q8_K

KERNELS = isa.simd_kernels(q2s.Q2_K_BYTE_DOT)
NUMBA = get_backend("numba", strict=True)


def plain(raw, a: Q8KAct) -> np.ndarray:
    out = np.empty((len(a.qs), raw.shape[0]), np.float32)
    isa.run_kernel(q2p.q2_K_kernel, raw, a.qs.astype(np.int16), a.d, a.bsums, isa.F16_TO_F32, out)
    return out


def simd(kernel, raw, a: Q8KAct) -> np.ndarray:
    out = np.empty((len(a.qs), raw.shape[0]), np.float32)
    isa.run_kernel(kernel, raw, np.ascontiguousarray(a.qs), a.d, np.ascontiguousarray(a.bsums), isa.F16_TO_F32, out)
    return out


def q2_K_rows(rng, rows: int, n: int, saturate: bool = False) -> np.ndarray:
    """Random Q2_K rows with finite f16 d/dmin; saturate: 80% of code and scale bytes 0xFF (q=3, sc=m=15)."""
    blocks = rng.integers(0, 256, (rows, n // 256, 84), dtype=np.uint8)
    if saturate:
        blocks[..., :80] = np.where(rng.random(blocks[..., :80].shape) < 0.8, np.uint8(0xFF), blocks[..., :80])
    for o in (80, 82):
        blocks[..., o:o + 2] = rng.uniform(-0.02, 0.02, blocks.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def test_simd_kernels_follow_the_host_features():
    f = llvm.get_host_cpu_features()
    if isa.config.CPU_NAME in (None, "host"):
        assert (q2s.q2_K_avx512_kernel in KERNELS) == bool(f.get("avx512bw", False))
        assert (q2s.q2_K_avx2_kernel in KERNELS) == bool(f.get("avx2", False))
    assert q2s.Q2_K_SIMD is (KERNELS[0] if KERNELS else None)


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.__name__)
def test_simd_equals_plain_kernel_on_ds4_experts(kernel, model, ops_A):
    """The real expert-down weights against ds4's recorded Q8_K activations: the same float32 bits."""
    _, w = model
    p = int(ops_A["positions"][0])
    for il in range(6):
        lw, k = w.layers[il], f"L{il}.P{p}.q8k.ffn_down_exps"
        a = Q8KAct(ops_A[k + ".qs"], ops_A[k + ".d"], ops_A[k + ".bsums"])        # all 6 slots at once: T = 6
        raw = np.ascontiguousarray(weight_rows(lw.ffn_down_exps.expert(int(ops_A[f"L{il}.P{p}.exp_ids"][0])), Q2_K))
        assert np.array_equal(simd(kernel, raw, a), plain(raw, a)), il


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.__name__)
@pytest.mark.parametrize("saturate", [False, True])
def test_simd_equals_plain_kernel_on_extreme_blocks(kernel, saturate):
    """Codes 3, scales 15 and activations -128 (the largest vpmaddubsw pair, -768): no saturation anywhere."""
    rng = np.random.default_rng(7)
    raw = q2_K_rows(rng, 37, 2048, saturate)
    qs = np.where(rng.random((3, 2048)) < 0.8, np.int8(-128), rng.integers(-128, 128, (3, 2048), dtype=np.int8))
    a = Q8KAct(qs, rng.uniform(0.001, 1, (3, 8)).astype(np.float32),
               qs.reshape(3, -1, 16).astype(np.int32).sum(-1).astype(np.int16))
    assert np.array_equal(simd(kernel, raw, a), plain(raw, a))


def test_backend_uses_either_path_with_the_same_bits(monkeypatch):
    """The numba backend with its SIMD choice, and forced onto q2_K_kernel (as on a CPU without the instructions)."""
    rng = np.random.default_rng(3)
    raw = q2_K_rows(rng, 600, 1024)                 # >= 512 rows: the threaded path
    a = quantize_q8_K(rng.standard_normal((2, 1024)).astype(np.float32))
    want = NUMPY.matvec_q2_K_q8_K(raw, a)
    assert np.array_equal(NUMBA.matvec_q2_K_q8_K(raw, a), want)
    monkeypatch.setattr(q2, "Q2_K_SIMD", None)       # the wrapper reads its own binding
    assert np.array_equal(NUMBA.matvec_q2_K_q8_K(raw, a), want)


def test_no_simd_kernels_for_a_generic_target(monkeypatch):
    monkeypatch.setattr(isa.config, "CPU_NAME", "generic")
    monkeypatch.setattr(isa.config, "CPU_FEATURES", None)
    assert isa.host_simd() == frozenset() and isa.simd_kernels(q2s.Q2_K_BYTE_DOT) == []


# IQ2_XXS: the byte-dot pair kernel against the portable iq2_xxs_pair_kernel
from ds4ref.quant import IQ2_XXS  # noqa: E402

IQ2_KERNELS = isa.simd_kernels(iq2a.IQ2_XXS_BYTE_DOT)


def iq2_pair(kernel, wg, wu, a: Q8KAct):
    """(gate, up) of a pair kernel: the portable one reads ds4's sign table, the byte-dot one
    spreads the signs from the block's own bits."""
    g, u = (np.empty((len(a.qs), wg.shape[0]), np.float32) for _ in range(2))
    tables = (iq2p.IQ2XXS_GRID, iq2p.IQ2XXS_SIGNS) if kernel is iq2p.iq2_xxs_pair_kernel else (iq2p.IQ2XXS_GRID,)
    isa.run_kernel(kernel, wg, wu, np.ascontiguousarray(a.qs), a.d, *tables, isa.F16_TO_F32, g, u)
    return g, u


def iq2_xxs_rows(rng, rows: int, n: int) -> np.ndarray:
    """Random IQ2_XXS rows (every grid index, sign index and scale) with finite f16 d."""
    blocks = rng.integers(0, 256, (rows, n // 256, 66), dtype=np.uint8)
    blocks[..., :2] = rng.uniform(-0.02, 0.02, blocks.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def test_grid_fits_the_byte_dot():
    assert set(np.unique(iq2p.IQ2XXS_GRID)) == {8, 25, 43}         # vpmaddubsw pairs <= 2 * 43 * 127


@pytest.mark.parametrize("kernel", IQ2_KERNELS, ids=lambda k: k.__name__)
def test_iq2_sign_spread_is_the_sign_table(kernel):
    """Row s has every 7-bit sign field equal to s (s = 0..127), so each of its weights reads sign row s of
    ds4's ksigns table, parity bit included; the spread in registers must give the portable kernel's bits."""
    rng = np.random.default_rng(17)
    rows = iq2_xxs_rows(rng, 128, 1024).reshape(128, 4, 66)
    s = np.arange(128, dtype=np.uint32)[:, None, None]
    scale = rng.integers(0, 16, (128, 4, 8), dtype=np.uint32)
    words = s | (s << 7) | (s << 14) | (s << 21) | (scale << 28)              # [128, 4 blocks, 8 groups]
    qs = rows[..., 2:].reshape(128, 4, 8, 8)
    qs[..., 4:] = words[..., None].view(np.uint8).reshape(128, 4, 8, 4)
    wg = np.ascontiguousarray(rows.reshape(128, -1))
    wu = np.ascontiguousarray(wg[::-1])
    a = quantize_q8_K(rng.standard_normal((2, 1024)).astype(np.float32))
    got, want = iq2_pair(kernel, wg, wu, a), iq2_pair(iq2p.iq2_xxs_pair_kernel, wg, wu, a)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


def test_q8_K_codes_never_reach_minus_128():
    """The byte path negates activations: quantize_q8_K must stay within [-127, 127], even at the extremes."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((64, 1024)).astype(np.float32) * np.float32(1e3)
    x[:, ::7] = -np.abs(x[:, ::7])
    x[0, :] = -1.0                                              # all at the negative maximum
    x[1, :] = np.float32(3.4e38) * np.sign(rng.standard_normal(1024)).astype(np.float32)
    qs = quantize_q8_K(x).qs
    assert qs.min() == -127 and qs.max() == 127


@pytest.mark.parametrize("kernel", IQ2_KERNELS, ids=lambda k: k.__name__)
def test_iq2_simd_equals_plain_kernel_on_ds4_experts(kernel, model, ops_A):
    """The real expert gate/up weights against ds4's recorded Q8_K activations: the same float32 bits."""
    _, w = model
    p = int(ops_A["positions"][0])
    for il in range(6):
        lw, k = w.layers[il], f"L{il}.P{p}.q8k.ffn_gate_up_exps"
        a = Q8KAct(ops_A[k + ".qs"].reshape(1, -1), ops_A[k + ".d"].reshape(1, -1), ops_A[k + ".bsums"].reshape(1, -1))
        e = int(ops_A[f"L{il}.P{p}.exp_ids"][0])
        wg = np.ascontiguousarray(weight_rows(lw.ffn_gate_exps.expert(e), IQ2_XXS))
        wu = np.ascontiguousarray(weight_rows(lw.ffn_up_exps.expert(e), IQ2_XXS))
        got, want = iq2_pair(kernel, wg, wu, a), iq2_pair(iq2p.iq2_xxs_pair_kernel, wg, wu, a)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), il


@pytest.mark.parametrize("kernel", IQ2_KERNELS, ids=lambda k: k.__name__)
def test_iq2_simd_equals_plain_kernel_on_extreme_blocks(kernel):
    """All grid/sign indices and scales 0..15, activations +-127 (the largest pairs, 2 * 43 * 127): same bits."""
    rng = np.random.default_rng(5)
    wg, wu = iq2_xxs_rows(rng, 41, 2048), iq2_xxs_rows(rng, 41, 2048)
    blocks = wu.reshape(41, -1, 66)                # 80% of wu's index/sign/scale bytes 0xFF: scale 15, sign row 127
    blocks[..., 2:] = np.where(rng.random(blocks[..., 2:].shape) < 0.8, np.uint8(0xFF), blocks[..., 2:])
    qs = np.where(rng.random((3, 2048)) < 0.8, np.int8(127) * rng.choice(np.int8([-1, 1]), (3, 2048)),
                  rng.integers(-127, 128, (3, 2048), dtype=np.int8)).astype(np.int8)
    a = Q8KAct(qs, rng.uniform(0.001, 1, (3, 8)).astype(np.float32),
               qs.reshape(3, -1, 16).astype(np.int32).sum(-1).astype(np.int16))
    got, want = iq2_pair(kernel, wg, wu, a), iq2_pair(iq2p.iq2_xxs_pair_kernel, wg, wu, a)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


def test_iq2_backend_uses_either_path_with_the_same_bits(monkeypatch):
    """NumbaBackend's IQ2_XXS pair with its SIMD choice, forced onto the portable kernel, and with a -128 code
    (which the byte path cannot negate: the backend routes it to the portable kernel)."""
    rng = np.random.default_rng(4)
    wg, wu = iq2_xxs_rows(rng, 600, 1024), iq2_xxs_rows(rng, 600, 1024)
    a = quantize_q8_K(rng.standard_normal((2, 1024)).astype(np.float32))
    odd = Q8KAct(a.qs.copy(), a.d, a.bsums)
    odd.qs[1, 5] = -128
    for act in (a, odd):
        want = NUMPY.matvec_iq2_xxs_pair_q8_K(wg, wu, act)
        got = NUMBA.matvec_iq2_xxs_pair_q8_K(wg, wu, act)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    monkeypatch.setattr(iq2, "IQ2_XXS_SIMD", None)
    got = NUMBA.matvec_iq2_xxs_pair_q8_K(wg, wu, a)
    assert np.array_equal(got[0], NUMPY.matvec_iq2_xxs_pair_q8_K(wg, wu, a)[0])


def test_iq2_simd_follows_the_host_features(monkeypatch):
    f = llvm.get_host_cpu_features()
    if isa.config.CPU_NAME in (None, "host"):
        assert (iq2a.iq2_xxs_pair_avx2_kernel in IQ2_KERNELS) == bool(f.get("avx2", False))
    assert iq2a.IQ2_XXS_SIMD is (IQ2_KERNELS[0] if IQ2_KERNELS else None)
    monkeypatch.setattr(isa.config, "CPU_NAME", "generic")
    monkeypatch.setattr(isa.config, "CPU_FEATURES", None)
    assert isa.simd_kernels(iq2a.IQ2_XXS_BYTE_DOT) == []


# Q8_0: the AVX-512 VNNI kernels (one token at a time, 16-token lanes) against q8_0_kernel
from ds4ref.matvec import matvec_q8_0_prequant  # noqa: E402
from ds4ref.quant import Q8Act  # noqa: E402

Q8_0_PAIRS = isa.simd_kernels(nv.Q8_0_BYTE_DOT)
NO_VNNI = "this CPU (or NUMBA_CPU_NAME) lacks AVX-512 VNNI + VL: the VNNI Q8_0 kernels cannot run here"


def q8_0_rows(rng, rows: int, nb: int, extreme: bool = True) -> np.ndarray:
    """Random Q8_0 rows (nb blocks) with finite f16 d; extreme: 30% of weight bytes -128 or 127."""
    blocks = rng.integers(0, 256, (rows, nb, 34), dtype=np.uint8)
    if extreme:
        q = blocks[..., 2:]
        blocks[..., 2:] = np.where(rng.random(q.shape) < 0.3, rng.choice(np.uint8([0x80, 0x7F]), q.shape), q)
    blocks[..., :2] = rng.uniform(-0.02, 0.02, (rows, nb, 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def q8_0_act(rng, T: int, nb: int) -> Q8Act:
    """Random Q8_0 activations, 30% of them -128 or 127, and a block of all -128 / all 127."""
    qs = rng.integers(-128, 128, (T, nb * 32), dtype=np.int8)
    qs = np.where(rng.random(qs.shape) < 0.3, rng.choice(np.int8([-128, 127]), qs.shape), qs).astype(np.int8)
    qs[0, :32] = -128
    qs[-1, -32:] = 127
    return Q8Act(qs, rng.uniform(0.001, 1, (T, nb)).astype(np.float32))


def q8_0_plain(raw, a: Q8Act) -> np.ndarray:
    out = np.empty((len(a.qs), raw.shape[0]), np.float32)
    isa.run_kernel(q8p.q8_0_kernel, raw, a.qs, a.d, isa.F16_TO_F32, out)
    return out


def q8_0_vnni(pair, raw, a: Q8Act, lanes: bool) -> np.ndarray:
    out = np.empty((len(a.qs), raw.shape[0]), np.float32)
    if lanes:
        isa.run_kernel(pair[1], raw, *nv.q8_0_lanes_operands(a.qs, a.d), len(a.qs), isa.F16_TO_F32, out)
    else:
        xc = 128 * a.qs.reshape(len(a.qs), -1, 32).sum(-1, dtype=np.int32)
        isa.run_kernel(pair[0], raw, a.qs, a.d, xc, isa.F16_TO_F32, out)
    return out


def test_vnni_follows_the_host_features(monkeypatch):
    f = llvm.get_host_cpu_features()
    if isa.config.CPU_NAME in (None, "host"):
        want = bool(f.get("avx512vnni", False) and f.get("avx512vl", False))
        assert ("avx512vnni" in isa.host_simd()) == want
        assert (len(Q8_0_PAIRS) == 1) == want
    assert nv.Q8_0_SIMD is (Q8_0_PAIRS[0] if Q8_0_PAIRS else None)
    monkeypatch.setattr(isa.config, "CPU_NAME", "generic")
    monkeypatch.setattr(isa.config, "CPU_FEATURES", None)
    assert isa.simd_kernels(nv.Q8_0_BYTE_DOT) == []


def test_q8_0_lanes_operands_layout():
    """Token l of tile k in lane l: bytes 4g..4g+3 of block b at xu[k, b, g, l] hold x + 128; padding is x = 0."""
    rng = np.random.default_rng(8)
    a = q8_0_act(rng, 19, 3)
    xu, xd16 = nv.q8_0_lanes_operands(a.qs, a.d)
    assert xu.shape == (2, 3, 8, 16, 4) and xu.dtype == np.uint8 and xd16.shape == (2, 3, 16)
    x = xu.astype(np.int32) - 128                                   # [tile, b, g, l, 4]
    tokens = x.transpose(0, 3, 1, 2, 4).reshape(32, 96)
    assert np.array_equal(tokens[:19], a.qs) and not tokens[19:].any()
    assert np.array_equal(xd16.transpose(0, 2, 1).reshape(32, 3)[:19], a.d) and not xd16.transpose(0, 2, 1).reshape(32, 3)[19:].any()


@pytest.mark.skipif(not Q8_0_PAIRS, reason=NO_VNNI)
@pytest.mark.parametrize("T", [1, 3, 4, 5, 16, 17, 128])
@pytest.mark.parametrize("lanes", [False, True], ids=["one_token", "lanes"])
def test_q8_0_vnni_equals_plain_kernel(T, lanes):
    """Both VNNI kernels, every T, rows odd (and below/above 512), nb not a multiple of 4: the same float32 bits as
    q8_0_kernel and as the numpy reference, extremes -128 / 127 in weights and activations."""
    rng = np.random.default_rng(T)
    for rows, nb in ((37, 7), (613, 41)):
        raw, a = q8_0_rows(rng, rows, nb), q8_0_act(rng, T, nb)
        want = q8_0_plain(raw, a)
        assert np.array_equal(want, matvec_q8_0_prequant(raw, a))
        assert np.array_equal(q8_0_vnni(Q8_0_PAIRS[0], raw, a, lanes), want), (rows, nb)


@pytest.mark.skipif(not Q8_0_PAIRS, reason=NO_VNNI)
def test_q8_0_vnni_at_the_integer_extremes():
    """All weights -128 against all activations -128 (the largest dot, 32 * 16384) and 127 against -128."""
    for wb, xv in ((0x80, -128), (0x7F, -128), (0x80, 127)):
        raw = np.full((3, 4 * 34), wb, np.uint8)
        raw.reshape(3, 4, 34)[..., :2] = np.array([0.5], np.float16).view(np.uint8)
        a = Q8Act(np.full((5, 128), xv, np.int8), np.ones((5, 4), np.float32))
        want = q8_0_plain(raw, a)
        assert want[0, 0] == 4 * 0.5 * 32 * int(np.uint8(wb).view(np.int8)) * xv
        for lanes in (False, True):
            assert np.array_equal(q8_0_vnni(Q8_0_PAIRS[0], raw, a, lanes), want)


def test_q8_0_backend_uses_either_path_with_the_same_bits(monkeypatch):
    """NumbaBackend's Q8_0 matvec with its VNNI choice (one token, lanes) and forced onto q8_0_kernel, on batches
    shaped [2, T, n] as well: the bits of the numpy reference."""
    rng = np.random.default_rng(6)
    raw = q8_0_rows(rng, 601, 32)
    for T in (1, 2, 3, 4, 9, 33):
        a = q8_0_act(rng, T, 32)
        want = matvec_q8_0_prequant(raw, a)
        assert np.array_equal(NUMBA.matvec_q8_0_prequant(raw, a), want), T
    a = q8_0_act(rng, 6, 32)
    batched = Q8Act(a.qs.reshape(2, 3, -1), a.d.reshape(2, 3, -1))
    assert np.array_equal(NUMBA.matvec_q8_0_prequant(raw, batched), matvec_q8_0_prequant(raw, batched))
    monkeypatch.setattr(q8, "Q8_0_SIMD", None)
    monkeypatch.setattr(q8, "Q8_0_AVX2", None)
    assert np.array_equal(NUMBA.matvec_q8_0_prequant(raw, a), matvec_q8_0_prequant(raw, a))


# Q8_0 by AVX2 (appendix D, D.6): |w| times sign(w) x by vpmaddubsw, one token at a time and 8-token lanes
import ds4ref.backends.numba.q8_0.avx2 as qa  # noqa: E402

Q8_0_AVX2_PAIRS = isa.simd_kernels(qa.Q8_0_AVX2_BYTE_DOT)
NO_AVX2 = "this CPU (or NUMBA_CPU_NAME) lacks AVX2: the AVX2 Q8_0 kernels cannot run here"


def q8_0_act_127(rng, T: int, nb: int) -> Q8Act:
    """Random Q8_0 activations in [-127, 127] (the AVX2 kernels' domain), 30% of them +-127, a block of all -127
    and one of all 127."""
    qs = rng.integers(-127, 128, (T, nb * 32), dtype=np.int8)
    qs = np.where(rng.random(qs.shape) < 0.3, rng.choice(np.int8([-127, 127]), qs.shape), qs).astype(np.int8)
    qs[0, :32] = -127
    qs[-1, -32:] = 127
    return Q8Act(qs, rng.uniform(0.001, 1, (T, nb)).astype(np.float32))


def q8_0_avx2(pair, raw, a: Q8Act, lanes: bool) -> np.ndarray:
    out = np.full((len(a.qs), raw.shape[0]), np.nan, np.float32)
    if lanes:
        isa.run_kernel(pair[1], raw, *qa.q8_0_avx2_lanes_operands(a.qs, a.d), len(a.qs), isa.F16_TO_F32, out)
    else:
        isa.run_kernel(pair[0], raw, np.ascontiguousarray(a.qs), a.d, isa.F16_TO_F32, out)
    return out


def test_q8_0_avx2_follows_the_host_features(monkeypatch):
    f = llvm.get_host_cpu_features()
    if isa.config.CPU_NAME in (None, "host"):
        assert (len(Q8_0_AVX2_PAIRS) == 1) == bool(f.get("avx2", False))
    assert qa.Q8_0_AVX2 is (Q8_0_AVX2_PAIRS[0] if Q8_0_AVX2_PAIRS else None)
    assert q8.Q8_0_AVX2 is qa.Q8_0_AVX2
    monkeypatch.setattr(isa.config, "CPU_NAME", "generic")
    monkeypatch.setattr(isa.config, "CPU_FEATURES", None)
    assert isa.simd_kernels(qa.Q8_0_AVX2_BYTE_DOT) == []


def test_q8_0_avx2_lanes_operands_layout():
    """Token l of tile k in lane l: bytes 4g..4g+3 of block b at xs[k, b, g, l], signed; padding x = 0, d = 0."""
    rng = np.random.default_rng(18)
    a = q8_0_act_127(rng, 11, 3)
    xs, xd8 = qa.q8_0_avx2_lanes_operands(a.qs, a.d)
    assert xs.shape == (2, 3, 8, 8, 4) and xs.dtype == np.int8 and xd8.shape == (2, 3, 8)
    tokens = xs.transpose(0, 3, 1, 2, 4).reshape(16, 96)
    assert np.array_equal(tokens[:11], a.qs) and not tokens[11:].any()
    d = xd8.transpose(0, 2, 1).reshape(16, 3)
    assert np.array_equal(d[:11], a.d) and not d[11:].any()
    assert xs[1, 2, 5, 2, 3] == a.qs[10, 64 + 4 * 5 + 3]


@pytest.mark.skipif(not Q8_0_AVX2_PAIRS, reason=NO_AVX2)
@pytest.mark.parametrize("T", [1, 2, 7, 8, 9, 16, 33, 128])
@pytest.mark.parametrize("lanes", [False, True], ids=["one_token", "lanes"])
def test_q8_0_avx2_equals_plain_kernel(T, lanes):
    """Both AVX2 kernels, every T, rows not a multiple of 4 (and below/above 512), nb not a multiple of 4, weights
    30% -128 / 127, activations 30% +-127: the same float32 bits as q8_0_kernel and the numpy reference."""
    rng = np.random.default_rng(300 + T)
    for rows, nb in ((37, 7), (613, 41)):
        raw, a = q8_0_rows(rng, rows, nb), q8_0_act_127(rng, T, nb)
        want = q8_0_plain(raw, a)
        assert np.array_equal(want, matvec_q8_0_prequant(raw, a))
        assert np.array_equal(q8_0_avx2(Q8_0_AVX2_PAIRS[0], raw, a, lanes), want), (rows, nb)


@pytest.mark.skipif(not Q8_0_AVX2_PAIRS, reason=NO_AVX2)
def test_q8_0_avx2_at_the_integer_extremes():
    """All weights -128 against all activations 127 / -127 (the largest pairs, +-2 * 128 * 127, which saturate
    int16 if w + 128 were the unsigned side) and 127 against -127: exact block sums."""
    for wb, xv in ((0x80, 127), (0x80, -127), (0x7F, -127), (0x7F, 127)):
        raw = np.full((5, 4 * 34), wb, np.uint8)
        raw.reshape(5, 4, 34)[..., :2] = np.array([0.5], np.float16).view(np.uint8)
        for T in (1, 9):
            a = Q8Act(np.full((T, 128), xv, np.int8), np.ones((T, 4), np.float32))
            want = q8_0_plain(raw, a)
            assert want[0, 0] == 4 * 0.5 * 32 * int(np.uint8(wb).view(np.int8)) * xv
            for lanes in (False, True):
                assert np.array_equal(q8_0_avx2(Q8_0_AVX2_PAIRS[0], raw, a, lanes), want), (wb, xv, T, lanes)


@pytest.mark.skipif(not Q8_0_AVX2_PAIRS, reason=NO_AVX2)
def test_q8_0_avx2_equals_plain_kernel_on_ds4_tensors(model, ops_A):
    """The real Q8_0 weights (attention, shared expert) against ds4's recorded activations, every recorded position
    of a layer as one batch (lanes) and the first alone (one token): the same float32 bits as q8_0_kernel."""
    _, w = model
    positions = [int(p) for p in ops_A["positions"]]
    cases = [("attn_q_a", "q8.attn_q_a"), ("attn_kv", "q8.attn_kv"), ("attn_output_b", "q8.attn_output_b"),
             ("ffn_gate_shexp", "q8.ffn_gate_shexp"), ("ffn_down_shexp", "q8.ffn_down_shexp")]
    for il in (0, 3, 5):
        for field, act in cases:
            keys = [f"L{il}.P{p}.{act}" for p in positions]
            a = Q8Act(np.concatenate([ops_A[k + ".qs"].reshape(-1, ops_A[k + ".qs"].shape[-1]) for k in keys]),
                      np.concatenate([ops_A[k + ".d"].reshape(-1, ops_A[k + ".d"].shape[-1]) for k in keys]))
            assert (a.qs != -128).all()
            raw = np.ascontiguousarray(weight_rows(getattr(w.layers[il], field), q8.Q8_0))
            for sub, lanes in ((Q8Act(a.qs[:1], a.d[:1]), False), (a, True)):
                want = q8_0_plain(raw, sub)
                assert np.array_equal(q8_0_avx2(Q8_0_AVX2_PAIRS[0], raw, sub, lanes), want), (il, field, lanes)


def test_q8_0_dispatch_picks_the_expected_kernel(monkeypatch):
    """numba_matvec_q8_0_prequant: VNNI where the CPU has it, else AVX2 (token lanes from the lanes threshold on,
    row lanes below, one row at a time for rows shorter than this CPU's ROWS_MIN_BLOCKS), else q8_0_kernel; an
    activation code -128 goes to q8_0_kernel on the AVX2 path. Every choice gives the numpy reference's bits."""
    rng = np.random.default_rng(9)
    raw = q8_0_rows(rng, 601, 16)
    called = []
    real_run = q8.run_kernel
    monkeypatch.setattr(q8, "run_kernel", lambda k, *args, **kw: (called.append(k), real_run(k, *args, **kw)))
    have = isa.host_simd()
    for T in (1, qa.Q8_0_AVX2_LANES_MIN_T - 1, qa.Q8_0_AVX2_LANES_MIN_T, 33):
        a = q8_0_act_127(rng, T, 16)
        for minus_128 in (False, True):
            if minus_128:
                a.qs[T - 1, 5] = -128
            called.clear()
            assert np.array_equal(NUMBA.matvec_q8_0_prequant(raw, a), matvec_q8_0_prequant(raw, a)), (T, minus_128)
            if "avx512vnni" in have:
                want = nv.Q8_0_SIMD[1] if T >= nv.Q8_0_LANES_MIN_T else nr.Q8_0_ROWS_VNNI
            elif "avx2" in have and not minus_128:
                few = nr.Q8_0_ROWS_AVX2 if 16 >= q8.ROWS_MIN_BLOCKS else qa.Q8_0_AVX2[0]
                want = qa.Q8_0_AVX2[1] if T >= qa.Q8_0_AVX2_LANES_MIN_T else few
            else:
                want = q8p.q8_0_kernel
            assert called == [want], (T, minus_128)
    if "avx2" in have:   # the AVX2 path as on a CPU without VNNI, and the portable one without AVX2
        monkeypatch.setattr(q8, "Q8_0_SIMD", None)
        for T in (1, qa.Q8_0_AVX2_LANES_MIN_T - 1):        # a few tokens: 8 rows in lanes
            a = q8_0_act_127(rng, T, 16)
            for min_blocks, want in ((0, nr.Q8_0_ROWS_AVX2), (17, qa.Q8_0_AVX2[0])):  # per CPU
                monkeypatch.setattr(q8, "ROWS_MIN_BLOCKS", min_blocks)
                called.clear()
                assert np.array_equal(NUMBA.matvec_q8_0_prequant(raw, a), matvec_q8_0_prequant(raw, a))
                assert called == [want], (T, min_blocks)
        a = q8_0_act_127(rng, 12, 16)
        called.clear()
        assert np.array_equal(NUMBA.matvec_q8_0_prequant(raw, a), matvec_q8_0_prequant(raw, a))
        monkeypatch.setattr(q8, "Q8_0_AVX2", None)
        assert np.array_equal(NUMBA.matvec_q8_0_prequant(raw, a), matvec_q8_0_prequant(raw, a))
        assert called == [qa.Q8_0_AVX2[1], q8p.q8_0_kernel]
    assert qa.Q8_0_AVX2_LANES_MIN_T >= 2


def test_q8_0_rows_min_blocks_cites_a_measurement_of_its_cpu():
    """Each CPU of Q8_0_ROWS_MIN_BLOCKS has a committed tools/q8_0_rows_ab.py run on that CPU, and the run agrees
    with the limit: rows shorter than it are clearly slower 8 at a time (paired time ratio > 1.1 at every thread
    count), rows at or above it are not slower (< 1.05)."""
    import json
    from ds4ref.dev.bench_timing import RESULTS_DIR
    runs = [json.loads(f.read_text()) for f in sorted(RESULTS_DIR.glob("q8_0_rows_*.json"))]
    assert q8.Q8_0_ROWS_MIN_BLOCKS
    for cpu, limit in q8.Q8_0_ROWS_MIN_BLOCKS.items():
        mine = [r for run in runs if run["machine"]["llvm_cpu"] == cpu for r in run["results"]]
        assert {r["n"] // 32 < limit for r in mine} == {True, False}, cpu   # both sides measured
        for r in mine:
            ratio = r["paired_ratio"]["avx2-8"]
            assert ratio > 1.1 if r["n"] // 32 < limit else ratio < 1.05, (cpu, r["rows"], r["n"], ratio)
    assert q8.ROWS_MIN_BLOCKS == q8.Q8_0_ROWS_MIN_BLOCKS.get(isa.host_cpu_name(), 0)

# Q8_0 decode in row lanes (appendix D, D.7): 16 (VNNI) or 8 (AVX2) rows per register
import ds4ref.backends.numba.q8_0.rows as nr  # noqa: E402

ROWS_CASES = [pytest.param(kernel, needs, marks=pytest.mark.skipif(
    needs not in isa.host_simd(), reason=f"this CPU (or NUMBA_CPU_NAME) lacks {needs}: the row-lanes kernel "
    "cannot run here"), id=needs) for kernel, needs in nr.Q8_0_ROWS_BYTE_DOT]


def q8_0_rows_kernel(kernel, raw, a: Q8Act) -> np.ndarray:
    out = np.full((len(a.qs), raw.shape[0]), np.nan, np.float32)
    xc = 128 * a.qs.reshape(len(a.qs), -1, 32).sum(-1, dtype=np.int32)
    isa.run_kernel(kernel, raw, np.ascontiguousarray(a.qs), np.ascontiguousarray(a.d), xc, isa.F16_TO_F32, out)
    return out


@pytest.mark.parametrize("kernel, needs", ROWS_CASES)
@pytest.mark.parametrize("T", [1, 2, 3])
def test_q8_0_rows_equal_plain_kernel(kernel, needs, T):
    """Row lanes, rows with a remainder after the last tile of 16 / 8 (and fewer rows than one tile), blocks with
    a remainder after the last group of 4, weights 30% -128 / 127, activations with -128 (VNNI) or +-127 (AVX2):
    the same float32 bits as q8_0_kernel and the numpy reference, every output written."""
    rng = np.random.default_rng(500 + T)
    act = q8_0_act if needs == "avx512vnni" else q8_0_act_127
    for rows, nb in ((5, 3), (37, 7), (613, 41), (64, 128)):
        raw, a = q8_0_rows(rng, rows, nb), act(rng, T, nb)
        want = q8_0_plain(raw, a)
        assert np.array_equal(want, matvec_q8_0_prequant(raw, a))
        assert np.array_equal(q8_0_rows_kernel(kernel, raw, a), want), (rows, nb)


@pytest.mark.parametrize("kernel, needs", ROWS_CASES)
def test_q8_0_rows_at_the_integer_extremes(kernel, needs):
    """All weights -128 or 127 against activations at the extremes of each kernel's domain: exact block sums."""
    low = -128 if needs == "avx512vnni" else -127
    for wb, xv in ((0x80, low), (0x7F, low), (0x80, 127)):
        raw = np.full((19, 5 * 34), wb, np.uint8)
        raw.reshape(19, 5, 34)[..., :2] = np.array([0.5], np.float16).view(np.uint8)
        a = Q8Act(np.full((2, 160), xv, np.int8), np.ones((2, 5), np.float32))
        want = q8_0_plain(raw, a)
        assert want[0, 0] == 5 * 0.5 * 32 * int(np.uint8(wb).view(np.int8)) * xv
        assert np.array_equal(q8_0_rows_kernel(kernel, raw, a), want), (wb, xv)


@pytest.mark.parametrize("kernel, needs", ROWS_CASES)
def test_q8_0_rows_equal_plain_kernel_on_ds4_tensors(kernel, needs, model, ops_A):
    """The oracle model's Q8_0 weights against ds4's recorded activations, one position at a time: q8_0_kernel's
    bits, which the oracle tests tie to ds4.c's."""
    _, w = model
    for il in (0, 5):
        for field, act in (("attn_q_a", "q8.attn_q_a"), ("attn_q_b", "q8.attn_q_b"),
                           ("attn_output_b", "q8.attn_output_b"), ("ffn_down_shexp", "q8.ffn_down_shexp")):
            k = f"L{il}.P{int(ops_A['positions'][0])}.{act}"
            a = Q8Act(ops_A[k + ".qs"].reshape(1, -1), ops_A[k + ".d"].reshape(1, -1))
            assert (a.qs != -128).all()
            raw = np.ascontiguousarray(weight_rows(getattr(w.layers[il], field), q8.Q8_0))
            assert np.array_equal(q8_0_rows_kernel(kernel, raw, a), q8_0_plain(raw, a)), (il, field)


def test_q8_0_rows_follow_the_host_features(monkeypatch):
    have = isa.host_simd()
    assert (nr.Q8_0_ROWS_VNNI is not None) == ("avx512vnni" in have) == (nv.Q8_0_SIMD is not None)
    assert (nr.Q8_0_ROWS_AVX2 is not None) == ("avx2" in have) == (qa.Q8_0_AVX2 is not None)
    monkeypatch.setattr(isa.config, "CPU_NAME", "generic")
    monkeypatch.setattr(isa.config, "CPU_FEATURES", None)
    assert isa.simd_kernels(nr.Q8_0_ROWS_BYTE_DOT) == []


# IQ2_XXS in lanes (appendix D, D.8): each row decoded once, 8 (AVX2) or 16 (AVX-512) tokens per vector,
# against the portable iq2_xxs_pair_kernel
import ds4ref.backends.numba.iq2_xxs.lanes as ni  # noqa: E402

HAVE = isa.host_simd()
LANES_CASES = [pytest.param(kernel, lanes, marks=pytest.mark.skipif(
    need not in HAVE, reason=f"this CPU (or NUMBA_CPU_NAME) lacks {need}: {kernel.__name__} cannot run here"),
    id=kernel.__name__) for (kernel, lanes), need in ni.IQ2_XXS_LANES_BYTE_DOT]


def iq2_lanes(kernel, lanes, wg, wu, qs, d):
    g, u = (np.full((len(qs), wg.shape[0]), np.nan, np.float32) for _ in range(2))
    xu, ydl = ni.iq2_xxs_lanes_operands(np.ascontiguousarray(qs), d, lanes)
    isa.run_kernel(kernel, wg, wu, xu, ydl, len(qs), iq2p.IQ2XXS_GRID, isa.F16_TO_F32, g, u)
    return g, u


def test_iq2_lanes_operands_layout():
    """xu[tile, b, j, l] = bytes 4j..4j+3 of block b of token 16 tile + l, plus 128; padding tokens y = 0, d = 0."""
    rng = np.random.default_rng(21)
    qs = rng.integers(-128, 128, (19, 512), dtype=np.int8)
    d = rng.uniform(0.1, 1, (19, 2)).astype(np.float32)
    for lanes in (8, 16):
        xu, ydl = ni.iq2_xxs_lanes_operands(qs, d, lanes)
        tiles = -(-19 // lanes)
        assert xu.shape == (tiles, 2, 64, lanes, 4) and xu.dtype == np.uint8 and ydl.shape == (tiles, 2, lanes)
        for t, b, j in ((0, 0, 0), (18, 1, 63), (lanes + 1, 1, 5), (7, 0, 31)):
            assert np.array_equal(xu[t // lanes, b, j, t % lanes].astype(np.int64),
                                  qs[t, 256 * b + 4 * j:256 * b + 4 * j + 4].astype(np.int64) + 128)
            assert ydl[t // lanes, b, t % lanes] == d[t, b]
        pad = xu.transpose(0, 3, 1, 2, 4).reshape(tiles * lanes, -1)[19:]
        assert (pad == 128).all() and (ydl.transpose(0, 2, 1).reshape(tiles * lanes, -1)[19:] == 0).all()


@pytest.mark.parametrize("kernel, lanes", LANES_CASES)
@pytest.mark.parametrize("T", [1, 5, 8, 16, 17, 40])
def test_iq2_lanes_equals_plain_kernel_on_extreme_blocks(kernel, lanes, T):
    """80% of the up rows' index/sign/scale bytes 0xFF (scale 15, sign row 127), activations mostly -128 or 127
    (the largest lanes, (y + 128) up to 255): the same float32 bits as iq2_xxs_pair_kernel, for tiles filled in
    full and in part."""
    wg, wu, qs, d, want = extreme_iq2_case(np.random.default_rng(100 + T), T)
    got = iq2_lanes(kernel, lanes, wg, wu, qs, d)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    assert np.isfinite(want[0]).all() and np.abs(want[1]).max() > 0


def extreme_iq2_case(rng, T: int):
    """45 gate/up rows of 2048, 80% of the up rows' index/sign/scale bytes 0xFF (scale 15, sign row 127); T
    activations mostly -128 or 127; and iq2_xxs_pair_kernel's (gate, up): (wg, wu, qs, d, want)."""
    wg, wu = iq2_xxs_rows(rng, 45, 2048), iq2_xxs_rows(rng, 45, 2048)
    blocks = wu.reshape(45, -1, 66)
    blocks[..., 2:] = np.where(rng.random(blocks[..., 2:].shape) < 0.8, np.uint8(0xFF), blocks[..., 2:])
    qs = np.where(rng.random((T, 2048)) < 0.7, rng.choice(np.int8([-128, 127]), (T, 2048)),
                  rng.integers(-128, 128, (T, 2048), dtype=np.int8)).astype(np.int8)
    d = rng.uniform(0.001, 1, (T, 8)).astype(np.float32)
    want = (np.empty((T, 45), np.float32), np.empty((T, 45), np.float32))
    isa.run_kernel(iq2p.iq2_xxs_pair_kernel, wg, wu, qs, d, iq2p.IQ2XXS_GRID, iq2p.IQ2XXS_SIGNS, isa.F16_TO_F32, *want)
    return wg, wu, qs, d, want


@pytest.mark.parametrize("kernel, lanes", LANES_CASES)
def test_iq2_lanes_equals_plain_kernel_on_ds4_experts(kernel, lanes, model, ops_A):
    """The real expert gate/up weights against ds4's recorded Q8_K activations, every recorded position of a
    layer as one batch (and the first alone): the same float32 bits as iq2_xxs_pair_kernel."""
    for il, n, wg, wu, qs, d, want in ds4_expert_batches(model, ops_A, range(6)):
        got = iq2_lanes(kernel, lanes, wg, wu, qs, d)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), (il, n)


def ds4_expert_batches(model, ops_A, layers):
    """(il, n, wg, wu, qs, d, want) for each layer: the gate/up rows of the first recorded expert, ds4's recorded
    Q8_K activations of the first position (n = 1) and of every recorded position (one batch), and
    iq2_xxs_pair_kernel's (gate, up) on them."""
    _, w = model
    positions = [int(p) for p in ops_A["positions"]]
    assert len(positions) > 1
    for il in layers:
        keys = [f"L{il}.P{p}.q8k.ffn_gate_up_exps" for p in positions]
        qs = np.stack([ops_A[k + ".qs"].reshape(-1) for k in keys])
        d = np.stack([ops_A[k + ".d"].reshape(-1) for k in keys]).astype(np.float32)
        e = int(ops_A[f"L{il}.P{positions[0]}.exp_ids"][0])
        wg = np.ascontiguousarray(weight_rows(w.layers[il].ffn_gate_exps.expert(e), IQ2_XXS))
        wu = np.ascontiguousarray(weight_rows(w.layers[il].ffn_up_exps.expert(e), IQ2_XXS))
        for n in (1, len(qs)):
            want = (np.empty((n, wg.shape[0]), np.float32), np.empty((n, wg.shape[0]), np.float32))
            isa.run_kernel(iq2p.iq2_xxs_pair_kernel, wg, wu, qs[:n], d[:n], iq2p.IQ2XXS_GRID, iq2p.IQ2XXS_SIGNS,
                          isa.F16_TO_F32, *want)
            yield il, n, wg, wu, qs[:n], d[:n], want


def test_iq2_backend_batches_take_the_lanes_kernel_with_the_same_bits(monkeypatch):
    """NumbaBackend's IQ2_XXS pair at T >= IQ2_XXS_LANES_MIN_T (a -128 code included: fine in lanes) equals numpy;
    the lanes kernel is the one called where the CPU has one, and forced off the result is the same."""
    rng = np.random.default_rng(6)
    wg, wu = iq2_xxs_rows(rng, 600, 1024), iq2_xxs_rows(rng, 600, 1024)
    T = max(ni.IQ2_XXS_LANES_MIN_T, 1) + 13
    a = quantize_q8_K(rng.standard_normal((T, 1024)).astype(np.float32))
    a.qs[3, 7] = -128
    want = NUMPY.matvec_iq2_xxs_pair_q8_K(wg, wu, a)
    called = []
    real_run = iq2.run_kernel
    monkeypatch.setattr(iq2, "run_kernel", lambda k, *args, **kw: (called.append(k), real_run(k, *args, **kw)))
    got = NUMBA.matvec_iq2_xxs_pair_q8_K(wg, wu, a)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    assert called == [iq2.IQ2_XXS_LANES[0] if iq2.IQ2_XXS_LANES is not None else iq2p.iq2_xxs_pair_kernel]
    monkeypatch.setattr(iq2, "IQ2_XXS_LANES", None)
    got = NUMBA.matvec_iq2_xxs_pair_q8_K(wg, wu, a)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    assert called[-1] is (iq2.IQ2_XXS_TOKENS or iq2p.iq2_xxs_pair_kernel)  # the -128 code: not the one-token byte path
    monkeypatch.setattr(iq2, "IQ2_XXS_TOKENS", None)
    got = NUMBA.matvec_iq2_xxs_pair_q8_K(wg, wu, a)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    assert called[-1] is iq2p.iq2_xxs_pair_kernel


# IQ2_XXS for a few tokens (appendix D, D.9): each row decoded once, then dotted with each token
NO_TOKENS = "this CPU (or NUMBA_CPU_NAME) lacks AVX2: the few-token IQ2_XXS kernel cannot run here"


def iq2_tokens(wg, wu, qs, d):
    g, u = np.full((len(qs), wg.shape[0]), np.nan, np.float32), np.full((len(qs), wg.shape[0]), np.nan, np.float32)
    isa.run_kernel(ni.IQ2_XXS_TOKENS, wg, wu, ni.iq2_xxs_tokens_operand(qs), d, iq2p.IQ2XXS_GRID,
                  isa.F16_TO_F32, g, u)
    return g, u


@pytest.mark.skipif(ni.IQ2_XXS_TOKENS is None, reason=NO_TOKENS)
@pytest.mark.parametrize("T", [1, 2, 3, 7, 12])
def test_iq2_tokens_equals_plain_kernel_on_extreme_blocks(T):
    """80% of the up rows' index/sign/scale bytes 0xFF, activations mostly -128 or 127 (y + 128 up to 255): the
    same float32 bits as iq2_xxs_pair_kernel, rows not a multiple of the 16 rows per task."""
    wg, wu, qs, d, want = extreme_iq2_case(np.random.default_rng(700 + T), T)
    got = iq2_tokens(wg, wu, qs, d)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    assert np.abs(want[1]).max() > 0


@pytest.mark.skipif(ni.IQ2_XXS_TOKENS is None, reason=NO_TOKENS)
def test_iq2_tokens_equals_plain_kernel_on_ds4_experts(model, ops_A):
    """The real expert gate/up weights against ds4's recorded Q8_K activations (a layer's recorded positions as
    one batch, and the first alone): iq2_xxs_pair_kernel's bits."""
    for il, n, wg, wu, qs, d, want in ds4_expert_batches(model, ops_A, (0, 2, 5)):
        got = iq2_tokens(wg, wu, qs, d)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), (il, n)


def test_iq2_dispatch_by_token_count(monkeypatch):
    """numba_matvec_iq2_xxs_pair_q8_K: lanes from IQ2_XXS_LANES_MIN_T on, the few-token kernel from 2 tokens (and
    for one token with a -128 code), the one-token byte path for one token without; always numpy's bits."""
    rng = np.random.default_rng(17)
    wg, wu = iq2_xxs_rows(rng, 300, 512), iq2_xxs_rows(rng, 300, 512)
    called = []
    real_run = iq2.run_kernel
    monkeypatch.setattr(iq2, "run_kernel", lambda k, *args, **kw: (called.append(k), real_run(k, *args, **kw)))
    assert 2 < ni.IQ2_XXS_LANES_MIN_T
    for T, minus_128 in ((1, False), (1, True), (2, False), (ni.IQ2_XXS_LANES_MIN_T - 1, True),
                         (ni.IQ2_XXS_LANES_MIN_T, False)):
        a = quantize_q8_K(rng.standard_normal((T, 512)).astype(np.float32))
        if minus_128:
            a.qs[0, 3] = -128
        called.clear()
        want = NUMPY.matvec_iq2_xxs_pair_q8_K(wg, wu, a)
        got = NUMBA.matvec_iq2_xxs_pair_q8_K(wg, wu, a)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), (T, minus_128)
        if iq2.IQ2_XXS_LANES is not None and T >= ni.IQ2_XXS_LANES_MIN_T:
            expect = iq2.IQ2_XXS_LANES[0]
        elif iq2.IQ2_XXS_TOKENS is not None and (T > 1 or minus_128):
            expect = iq2.IQ2_XXS_TOKENS
        elif iq2.IQ2_XXS_SIMD is not None and not minus_128:
            expect = iq2.IQ2_XXS_SIMD
        else:
            expect = iq2p.iq2_xxs_pair_kernel
        assert called == [expect], (T, minus_128)
    assert (ni.IQ2_XXS_TOKENS is not None) == ("avx2" in isa.host_simd())


def test_iq2_lanes_follow_the_host_features(monkeypatch):
    order = [need for _, need in ni.IQ2_XXS_LANES_BYTE_DOT]
    assert order == ["avx512vnni", "avx512bw", "avx2"]              # widest first
    first = next((k for k, need in ni.IQ2_XXS_LANES_BYTE_DOT if need in HAVE), None)
    assert ni.IQ2_XXS_LANES == first and iq2.IQ2_XXS_LANES == first
    if first is not None:
        assert first[1] == (16 if first[0] is not ni.iq2_xxs_pair_lanes_avx2_kernel else 8)
    monkeypatch.setattr(isa.config, "CPU_NAME", "generic")
    monkeypatch.setattr(isa.config, "CPU_FEATURES", None)
    assert isa.simd_kernels(ni.IQ2_XXS_LANES_BYTE_DOT) == []


# the grouped output projection of one token in one loop (appendix D, D.7; chapter 3's matvec_q8_0_grouped)
def test_q8_0_grouped_equals_the_composed_reference(monkeypatch):
    """NumbaBackend.project_grouped: one token's 8 groups in one parallel loop (where the CPU has a row-lanes
    kernel), a batch and a rank the kernel cannot take through the composition: numpy's bits, and the grouped
    kernel is the one call for the single token; rows that do not split into the groups raise MatvecError."""
    rng = np.random.default_rng(23)
    G, rank, nb = 8, 48, 5
    raw = q8_0_rows(rng, G * rank, nb)
    called = []
    real_run = q8.run_kernel
    monkeypatch.setattr(q8, "run_kernel", lambda k, *args, **kw: (called.append(k), real_run(k, *args, **kw)))
    for shape in ((1, G, 32 * nb), (3, G, 32 * nb)):
        x = rng.standard_normal(shape).astype(np.float32)
        called.clear()
        got, want = NUMBA.project_grouped(raw, x), NUMPY.project_grouped(raw, x)
        assert got.shape == shape[:-1] + (rank,) and np.array_equal(got, want), shape
        if shape[0] == 1 and nr.Q8_0_ROWS_GROUPED is not None:
            assert called == [nr.Q8_0_ROWS_GROUPED[0]]
    x = rng.standard_normal((1, G, 32 * nb)).astype(np.float32)
    odd = q8_0_rows(rng, G * 20, nb)                       # rank 20: not a multiple of 8 or 16
    assert np.array_equal(NUMBA.project_grouped(odd, x), NUMPY.project_grouped(odd, x))
    from ds4ref.matvec import MatvecError
    with pytest.raises(MatvecError, match="do not split into"):
        NUMBA.project_grouped(q8_0_rows(rng, 30, nb), x)


def test_q8_0_grouped_kernels_on_ds4_attention_output(model, ops_A):
    """The oracle model's attn_output_a against ds4's recorded grouped input of every recorded position: the bits
    ds4.c recorded (attn_low), through the grouped kernel where the CPU has one."""
    cfg, w = model
    for il in (0, 3):
        for p in [int(p) for p in ops_A["positions"]][:3]:
            heads = ops_A[f"L{il}.P{p}.heads_unrope"].reshape(cfg.n_out_group, -1)
            low = NUMBA.project_grouped(w.layers[il].attn_output_a.data, heads[None])
            assert np.array_equal(low.reshape(-1), ops_A[f"L{il}.P{p}.attn_low"].reshape(-1)), (il, p)


# F16 by vcvtph2ps (appendix D, D.10)
import ds4ref.backends.numba.f16 as nf  # noqa: E402


def test_f16_simd_follows_the_host_features_and_is_the_matvecs_choice(monkeypatch):
    assert (nf.F16_SIMD is not None) == ("avx2" in isa.host_simd())
    assert nf.F16_SIMD is nf.F16_SIMD
    monkeypatch.setattr(isa.config, "CPU_NAME", "generic")
    monkeypatch.setattr(isa.config, "CPU_FEATURES", None)
    assert isa.simd_kernels(((nf.f16_f16c_kernel, "avx2"),)) == []


@pytest.mark.skipif(nf.F16_SIMD is None, reason="this CPU (or NUMBA_CPU_NAME) lacks AVX2/F16C: the vcvtph2ps kernel "
                    "cannot run here")
@pytest.mark.parametrize("n", [16, 100, 1000, 4096])
def test_f16_simd_equals_an_exact_float64_dot_within_float32_rounding(n):
    """Every f16 pattern class (normal, subnormal, the largest finite, signed zero) converted exactly: the
    kernel's dots against float64 sums of the exact products, within a few float32 ulps of the row's absolute
    sum; lengths leaving remainders after 64 and 16; each (token, row) as it is alone."""
    rng = np.random.default_rng(n)
    w = rng.standard_normal((21, n)).astype(np.float16)
    w.reshape(-1)[:8] = np.array([6.1e-05, 5.96e-08, 65504.0, -0.0, 1e-6, -65504.0, 2.0 ** -24, 3.0],
                                 np.float16)[: min(8, w.size)]
    x = rng.standard_normal((5, n)).astype(np.float32)
    out = np.empty((5, 21), np.float32)
    isa.run_kernel(nf.F16_SIMD, w.view(np.uint16), x, isa.F16_TO_F32, out)
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    scale = np.abs(x).astype(np.float64) @ np.abs(w.astype(np.float64)).T
    assert (np.abs(out - exact) <= 8 * np.finfo(np.float32).eps * scale + 1e-30).all()
    alone = np.empty((1, 21), np.float32)
    isa.run_kernel(nf.F16_SIMD, w.view(np.uint16), np.ascontiguousarray(x[3:4]), isa.F16_TO_F32, alone)
    assert np.array_equal(alone[0], out[3])


# DS4REF_SIMD narrows the probe (appendix D.3): one machine runs another's code paths
import subprocess  # noqa: E402
import sys  # noqa: E402

_LOGITS = """
import sys, numpy as np
from ds4ref.engine import Engine
from ds4ref.backends.numba.isa import host_simd
eng = Engine.open("data/oracle/dev_seed1.gguf", backend="numba")
s = eng.session(ctx_size=128)
s.sync([0, 511, 574, 370, 228, 17, 42, 99, 7, 300, 301, 302])
rows = [s.logits.copy()]
for tok in (5, 77, 300, 12):
    rows.append(s.eval(tok).copy())
np.save(sys.argv[1], np.stack(rows))
print(",".join(sorted(host_simd())))
"""


def _run(code: str, level: str | None, *args) -> subprocess.CompletedProcess:
    import os
    from pathlib import Path
    env = {k: v for k, v in os.environ.items() if k != "DS4REF_SIMD"}
    if level is not None:
        env["DS4REF_SIMD"] = level
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], env=env, capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1])


def test_ds4ref_simd_narrows_the_probe_and_rejects_unknown_levels():
    probe = "from ds4ref.backends.numba.isa import host_simd; print(','.join(sorted(host_simd())))"
    full = _run(probe, None).stdout.strip()
    assert _run(probe, "avx512").stdout.strip() == full
    assert _run(probe, "avx2").stdout.strip() == ("avx2" if "avx2" in full.split(",") else "")
    assert _run(probe, "none").stdout.strip() == ""
    bad = _run("import ds4ref.backends.numba.backend", "avx9")
    assert bad.returncode != 0
    assert "SimdSettingError: DS4REF_SIMD='avx9': expected one of none, avx2, avx512" in bad.stderr


@pytest.mark.skipif("avx2" not in isa.host_simd(), reason="this CPU (or NUMBA_CPU_NAME) lacks AVX2: no AVX2 path to "
                    "compare")
def test_the_avx2_path_gives_the_engine_the_same_bits(tmp_path):
    """The numba engine on the oracle model (a 12-token prefill, 4 decode steps) with the probe narrowed to AVX2
    gives the bits of its own default path: every kernel the AVX-512 path swaps in is bit-exact with its AVX2
    twin (and with the portable kernel), and both take the same F16C kernel. On a CPU without AVX-512 both runs
    take the same kernels."""
    runs = {}
    for level in (None, "avx2"):
        out = tmp_path / f"{level}.npy"
        r = _run(_LOGITS, level, out)
        assert r.returncode == 0, r.stderr
        runs[level] = (r.stdout.strip(), np.load(out))
    assert runs["avx2"][0] == "avx2"
    assert np.array_equal(runs[None][1], runs["avx2"][1])


def test_the_probe_reads_the_features_numba_compiles_for(monkeypatch):
    """With NUMBA_CPU_NAME set (numba compiling for another CPU, as tools/check_portability.sh's zen3
    setting does), the probe takes that target's NUMBA_CPU_FEATURES, not this CPU's: a Zen 3's list gives the
    AVX2 kernels, an AVX-512 list the AVX-512 ones, and no list none."""
    monkeypatch.delenv("DS4REF_SIMD", raising=False)
    monkeypatch.setattr(isa.config, "CPU_NAME", "znver3")
    monkeypatch.setattr(isa.config, "CPU_FEATURES", "+avx2,+fma,+f16c,-avx512f,-avx512bw,-avx512vl,-avx512vnni")
    assert isa.host_simd() == frozenset({"avx2"})
    monkeypatch.setattr(isa.config, "CPU_FEATURES", "+avx2,+avx512f,+avx512bw,+avx512vl,+avx512vnni")
    assert isa.host_simd() == frozenset({"avx2", "avx512bw", "avx512vnni"})
    monkeypatch.setattr(isa.config, "CPU_FEATURES", "+avx2,+avx512bw,-avx512vl,+avx512vnni")
    assert isa.host_simd() == frozenset({"avx2", "avx512bw"})      # the VNNI dot needs VL
    monkeypatch.setattr(isa.config, "CPU_FEATURES", None)
    assert isa.host_simd() == frozenset()

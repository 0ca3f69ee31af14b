"""Appendix D's ladder: every rung the CPU runs computes the numpy reference's matvec
(the same bits; F16 within 1e-5), for one token and a batch. No timing here."""
import numpy as np
import pytest

from ds4ref.dev.bench import weight_pool
from ds4ref.dev.ladder import RUNGS, activation, same_as_reference


@pytest.mark.parametrize("kind", sorted(RUNGS))
@pytest.mark.parametrize("T", [1, 5, 33])
def test_every_rung_computes_the_reference(kind, T):
    rng = np.random.default_rng(T)
    n_in, n_out = (512, 40) if kind != "Q2_K" else (256, 40)
    pool = weight_pool(kind, n_in, n_out, 1, rng)     # two copies of one small weight
    w = (pool[0], pool[1]) if kind == "IQ2_XXS" else pool[0]
    a = activation(kind, n_in, T, rng)
    rungs = RUNGS[kind](T)
    assert rungs[0][0] == "numpy reference"
    ref = rungs[0][1](w, a)
    for name, fn in rungs[1:]:
        assert same_as_reference(kind, fn(w, a), ref), name


def test_same_as_reference_sees_a_one_ulp_change():
    ref = np.float32([[1.0, -2.0, 3.0]])
    ours = ref.copy()
    ours[0, 1] = np.nextafter(ours[0, 1], np.float32(0))
    assert not same_as_reference("Q8_0", ours, ref)
    assert same_as_reference("F16", ours, ref)
    assert not same_as_reference("F16", ref * 1.001, ref)


@pytest.mark.skipif("avx2" not in __import__("ds4ref.backends.numba.isa",
                                              fromlist=["host_simd"]).host_simd(),
                    reason="the byte-dot peak loop is AVX2 code; this CPU has no AVX2")
@pytest.mark.parametrize("rounds", [1, 2, 300])
def test_byte_dot_peak_loop_does_the_multiply_adds_it_counts(rounds):
    """The peak loop's sum from an independent formula: round r multiplies b = (1 + r)
    mod 256 (read as int8) by a_k = k + 2 in all 32 bytes of 8 registers, so it adds
    32 * b * sum_k (k + 2) = 32 * 44 * b; PEAK_MACS_PER_ROUND counts those 8 * 32."""
    from numba import njit

    from ds4ref.dev.ladder import PEAK_MACS_PER_ROUND, _byte_dot_rounds

    run = njit(lambda n: _byte_dot_rounds(n))
    b = (np.arange(1, rounds + 1) + 1) % 256
    b = np.where(b > 127, b - 256, b)                     # the byte as int8
    assert run(rounds) == 32 * 44 * int(b.sum())
    assert PEAK_MACS_PER_ROUND == 8 * 32

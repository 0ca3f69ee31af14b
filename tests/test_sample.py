"""Sampling as ds4.c orders it: argmax, top-k, min-p, top-p, and the xorshift64* generator."""
from __future__ import annotations

import numpy as np
import pytest

from ds4ref.sample import (SampleRNG, SamplingError, filtered_distribution, sample, sample_argmax)


def _xorshift64star_numpy(seed: int, n: int) -> list[int]:
    """Independent xorshift64* in numpy uint64 (wrapping) arithmetic, from the published recipe."""
    x = np.uint64(seed if seed else 0x9E3779B97F4A7C15)
    out = []
    with np.errstate(over="ignore"):
        for _ in range(n):
            x ^= x >> np.uint64(12)
            x ^= x << np.uint64(25)
            x ^= x >> np.uint64(27)
            out.append(int(x * np.uint64(0x2545F4914F6CDD1D)))
    return out


@pytest.mark.parametrize("seed", [0, 1, 42, 2**63 + 12345, 2**64 - 1])
def test_rng_matches_independent_xorshift64star(seed):
    r = SampleRNG(seed)
    assert [r.next_u64() for _ in range(50)] == _xorshift64star_numpy(seed, 50)


def test_rng_float_uses_top_24_bits():
    r, ref = SampleRNG(7), _xorshift64star_numpy(7, 1000)
    us = [r.next_f32() for _ in range(1000)]
    assert all(u == np.float32((x >> 40) / 2**24) for u, x in zip(us, ref))
    assert min(us) >= 0 and max(us) < 1


def test_temperature_zero_is_argmax_first_maximum():
    logits = np.array([0.5, 3.0, -1.0, 3.0, np.nan], np.float32)
    assert sample_argmax(logits) == 1
    assert sample(logits, temperature=0.0) == 1
    assert sample(logits, 0.0, top_k=2, top_p=0.5, min_p=0.9) == 1


def test_argmax_of_all_nan_or_neg_inf_is_zero():
    assert sample_argmax(np.full(5, np.nan, np.float32)) == 0
    assert sample_argmax(np.full(5, -np.inf, np.float32)) == 0


def test_min_p_drops_tokens_below_fraction_of_best():
    logits = np.log(np.array([0.5, 0.3, 0.12, 0.06, 0.02], np.float32))
    # min_p = 0.2: keep p >= 0.2 * 0.5 = 0.1 -> tokens 0, 1, 2
    for top_k in (0, 5):
        d = filtered_distribution(logits, 1.0, top_k=top_k, min_p=0.2)
        assert np.flatnonzero(d).tolist() == [0, 1, 2]
        np.testing.assert_allclose(d[:3], np.array([0.5, 0.3, 0.12]) / 0.92, rtol=1e-6)


def test_top_p_keeps_smallest_prefix_reaching_p():
    logits = np.log(np.array([0.5, 0.3, 0.12, 0.06, 0.02], np.float32))
    assert np.flatnonzero(filtered_distribution(logits, 1.0, top_p=0.79)).tolist() == [0, 1]
    assert np.flatnonzero(filtered_distribution(logits, 1.0, top_p=0.81)).tolist() == [0, 1, 2]
    assert np.flatnonzero(filtered_distribution(logits, 1.0, top_p=0.5)).tolist() == [0]
    # top-p is measured against the top-k mass: of the best 2 (0.5, 0.3), 0.6 of 0.8 needs only token 0
    assert np.flatnonzero(filtered_distribution(logits, 1.0, top_k=2, top_p=0.6)).tolist() == [0]
    assert np.flatnonzero(filtered_distribution(logits, 1.0, top_k=2, top_p=0.63)).tolist() == [0, 1]


def test_top_k_ties_go_to_the_lower_id():
    logits = np.array([1.0, 2.0, 2.0, 2.0, 0.0], np.float32)
    d = filtered_distribution(logits, 1.0, top_k=2)
    assert np.flatnonzero(d).tolist() == [1, 2]


def test_seeded_run_repeats_and_seeds_differ():
    logits = np.random.default_rng(0).normal(size=1000).astype(np.float32) * 2
    draw = lambda seed: [sample(logits, 0.8, 40, 0.95, 0.01, rng) for rng in [SampleRNG(seed)] for _ in range(200)]
    a, b, c = draw(123), draw(123), draw(124)
    assert a == b and a != c


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_k=8),
                                    dict(temperature=1.3, top_p=0.8), dict(temperature=1.0, min_p=0.1),
                                    dict(temperature=0.9, top_k=10, top_p=0.9, min_p=0.05)])
def test_empirical_distribution_matches_filtered_softmax_chi_square(params):
    """20,000 seeded draws; Pearson chi-square against the filtered softmax, 0.1 % significance."""
    logits = np.random.default_rng(3).normal(size=24).astype(np.float32)
    p = filtered_distribution(logits, **params)
    rng = SampleRNG(2024)
    n = 20_000
    counts = np.bincount([sample(logits, rng=rng, **params) for _ in range(n)], minlength=len(logits))
    assert counts[p == 0].sum() == 0, "a filtered-out token was drawn"
    live = p > 0
    chi2 = (((counts[live] - n * p[live]) ** 2) / (n * p[live])).sum()
    dof = live.sum() - 1
    # chi-square 99.9 % quantile via Wilson-Hilferty (dof >= 1)
    z = 3.090
    crit = dof * (1 - 2 / (9 * dof) + z * np.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < crit, (chi2, crit, dof)


def test_draw_walk_matches_float32_loop():
    """The vectorised walk equals ds4.c's sequential float32 `r -= p` loop on random cases."""
    rng_np = np.random.default_rng(5)
    for _ in range(200):
        logits = rng_np.normal(size=64).astype(np.float32) * 3
        k = int(rng_np.integers(1, 64))
        seed = int(rng_np.integers(1, 2**63))
        got = sample(logits, 1.0, top_k=k, top_p=1.0, rng=SampleRNG(seed))
        # reference: the C loop, written out in float32 scalars
        order = np.argsort(-logits, kind="stable")[:k]
        probs = np.exp((logits[order] - logits[order[0]]).astype(np.float64)).astype(np.float32)
        total = np.float32(0)
        for q in probs:
            total = np.float32(total + q)
        r = np.float32(SampleRNG(seed).next_f32() * total)
        want = order[-1]
        for i, q in enumerate(probs):
            r = np.float32(r - q)
            if r <= 0:
                want = order[i]
                break
        assert got == want


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(temperature=float("nan")),
                                 dict(top_p=0.0), dict(top_p=1.5), dict(min_p=-0.1), dict(min_p=2.0),
                                 dict(top_k=-1), dict(top_k=2.5)])
def test_bad_parameters_raise_sampling_error(bad):
    args = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) | bad
    with pytest.raises(SamplingError):
        sample(np.zeros(4, np.float32), rng=SampleRNG(1), **args)


def test_missing_rng_and_empty_logits_raise():
    with pytest.raises(SamplingError, match="rng"):
        sample(np.zeros(4, np.float32), 1.0)
    with pytest.raises(SamplingError, match="empty"):
        sample(np.zeros(0, np.float32), 1.0, rng=SampleRNG(1))


@pytest.mark.parametrize("case", ["C", "A"])
def test_draws_equal_ds4c_session_sample(case, oracle_dir):
    """Every draw of ds4.c's own `ds4_session_sample` on the golden prompt logits, over a grid of
    temperature x top_k x top_p x min_p x 3 seeds, 40 draws each (data/oracle/ds4c_sample.npz, recorded by
    tools/ds4c/record.py), and the generator state after the last draw."""
    rec = np.load(oracle_dir / "ds4c_sample.npz")
    logits = np.load(oracle_dir / f"golden_{case}.npz")["prompt_logits"]
    params, seeds = rec["params"], rec["seeds"]
    draws, rng_after = rec[f"{case}.draws"], rec[f"{case}.rng_after"]
    assert len(params) == len(draws) == 432 and len(set(draws.ravel().tolist())) > 50
    for row, seed, want, state in zip(params, seeds, draws, rng_after):
        t, k, p, mp = (float(np.float32(row[0])), int(row[1]), float(np.float32(row[2])), float(np.float32(row[3])))
        rng = SampleRNG(int(seed))
        got = [sample(logits, t, k, p, mp, rng) for _ in range(int(row[6]))]
        assert got == want.tolist(), (t, k, p, mp, int(seed))
        assert rng.state == int(state)


def test_filtered_distribution_takes_tiny_temperatures_as_sample_does():
    """1e-50 is 0 as a float32 (ds4.c's), so the distribution is the argmax's; 1e-45 is
    float32's least: every token but the best gets weight 0, without a warning."""
    import warnings
    logits = np.array([1.0, 3.0, 2.0, 0.0], np.float32)
    one_hot = filtered_distribution(logits, 0)
    assert one_hot.tolist() == [0, 1, 0, 0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for t in (1e-50, 1e-45):
            for kw in ({}, dict(top_k=2)):
                assert filtered_distribution(logits, t, **kw).tolist() == one_hot.tolist()

"""The whole model against ds4.c, end to end; the session API; the CLI.

The oracle runs (case A: 300-token prompt + 32 steps, on both ds4 paths, with and without ds4's
decisions replayed) are computed once per module and shared by the tests below.
"""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds4ref.backend import NUMPY
from ds4ref.dev.oracle import (
    COUNTS,
    EXPERT_MEASURES,
    INDEXER_MEASURES,
    Rebuilds,
    check_decisions,
    stacked,
    SHADOW_TRACE,
    YardstickError,
    distance_to_golden,
    golden_rows,
    run_rows,
    decision_mismatches,
    decisions_from_golden,
    logit_agreement,
    replay_golden,
    shadow_decisions,
)
from ds4ref.session import (
    ContextOverflowError,
    EmptyPromptError,
    NoLogitsError,
    SessionError,
    TokenRangeError,
)
from ds4ref.engine import Engine
from ds4ref.sample import SampleRNG, SamplingError
from ds4ref.trace import NO_TRACE, Trace

LOOSE = dict(corr=0.98, mean_abs=0.3, max_abs=1.5)          # data/oracle/README.md "How to compare" 3
DECISION_MARGIN = 1e-2                                       # README 2: above this a mismatch is a bug
NEAR_TIE = 0.25                                              # README 4: greedy compare up to this gap
ORACLE_TRACE = ["exp_ids", "idx_selected", "router_biased", *SHADOW_TRACE]


@pytest.fixture(scope="module")
def engine(oracle_gguf):
    return Engine.open(oracle_gguf, backend="numpy")          # the reference (the default "auto" is numba)


def _runs(engine, golden):
    out = {}
    for path in ("batch", "stream"):
        for forced in (False, True):
            tr = Trace(names=ORACLE_TRACE)
            out[path, forced] = replay_golden(engine, golden, path, forced, trace=tr)
            out[path, forced]["trace"] = tr
            out[path, forced]["decisions"] = shadow_decisions(engine.cfg, engine.weights, tr)
    return out


@pytest.fixture(scope="module")
def runs_A(engine, golden_A):
    return _runs(engine, golden_A)


@pytest.fixture(scope="module")
def runs_C(engine, golden_C):
    return _runs(engine, golden_C)


def _rows(run, golden, path):
    """(ours, ds4's) logit rows of one run: prompt or every stream position, then the steps."""
    if path == "batch":
        ours = np.vstack([run["prompt_logits"][None], run["step_logits"]])
        ref = np.vstack([golden["prompt_logits"][None], golden["step_logits"]])
    else:
        ours = np.vstack([run["pos_logits"], run["step_logits"]])
        ref = np.vstack([golden["stream_pos_logits"], golden["stream_step_logits"]])
    return ours, ref


@pytest.mark.parametrize("case", ["A", "C"])
@pytest.mark.parametrize("path", ["batch", "stream"])
def test_logits_with_ds4_decisions_forced_meet_the_tight_aim(case, path, request):
    """With ds4's expert and indexer choices replayed, every row is within corr >= 0.995, max |d| <= 1.0
    (closer to ds4.c than llama.cpp's port gets: corr >= 0.984, max abs <= 1.58) and the loose mean bound.
    A fixed bound is sound here: with no decision left to flip, the two runs drift apart continuously
    by rounding (a flipped Q8_0 code moves a projection by ~1e-2 relative, not a row by an expert)."""
    runs, golden = request.getfixturevalue(f"runs_{case}"), request.getfixturevalue(f"golden_{case}")
    ours, ref = _rows(runs[path, True], golden, path)
    m = logit_agreement(ours, ref)
    print(f"case {case} {path:6s} forced: rows={len(ours)} min corr {m['corr'].min():.4f} "
          f"max mean|d| {m['mean_abs'].max():.3f} max|d| {m['max_abs'].max():.3f}")
    assert m["corr"].min() >= 0.995 and m["max_abs"].max() <= 1.0
    assert m["mean_abs"].max() <= LOOSE["mean_abs"]


# ds4.c rebuilt from the same source with other compiler flags (data/oracle/rebuilds.json, made by
# tools/ds4c/rebuilds.py): how far ds4.c itself lands from its golden files. A free-running ds4ref may be at
# most REBUILD_SLACK further than the furthest rebuild on each measure (ds4ref.dev.oracle.Rebuilds, chapter
# 8). The rebuilds are six samples of ds4.c's rounding chaos on one machine kind; ds4ref on another SIMD path
# is a seventh: with OpenBLAS's Sandybridge kernel and numpy's AVX-512 paths off, ds4ref lands 11-12 % beyond
# the furthest rebuild on two measures (case A batch median row, case C batch worst corr). A wrong op lands
# far outside it. This is the criterion of every free run against ds4.c in the suite: no margin set on one
# machine.
ROOT = Path(__file__).resolve().parents[1]
# the cases the rebuild data cover (A and C of the shared oracle, "bundled" from tools/ds4c/record.py, and any
# case added with `rebuilds.py --case`): name -> {"golden": file, "model": file or "bundled"}
REBUILD_CASES = json.loads((ROOT / "data/oracle/rebuilds.json").read_text())["cases"]
_FREE_RUNS: dict = {}


@pytest.fixture(scope="module")
def rebuilds(oracle_dir):
    return Rebuilds(oracle_dir)


def case_model(case: str):
    """(golden arrays, model path) of one rebuild case; the bundled model must be the file ds4.c ran (its
    sha256 is in the golden file)."""
    import hashlib
    from ds4ref.dev.writer import synthetic_model_path
    spec = REBUILD_CASES[case]
    golden = np.load(ROOT / spec["golden"])
    path = synthetic_model_path() if spec["model"] == "bundled" else ROOT / spec["model"]
    if "model_sha256" in golden.files:
        assert hashlib.sha256(path.read_bytes()).hexdigest() == str(golden["model_sha256"]), \
            f"{path} is not the model ds4.c ran for case {case} (writer output changed?)"
    return golden, path


def free_run(case: str, path: str, backend: str, request):
    """(golden, rows, expert ids [R, n_routed, 6]) of a free-running replay of one case and path on a
    backend; numpy's runs of A and C are the module's oracle runs."""
    key = case, path, backend
    if key not in _FREE_RUNS:
        if backend == "numpy" and case in ("A", "C"):
            golden, run = request.getfixturevalue(f"golden_{case}"), request.getfixturevalue(f"runs_{case}")[path, False]
            tr, cfg = run["trace"], request.getfixturevalue("engine").cfg
        else:
            golden, model = case_model(case)
            eng = Engine.open(model, backend=backend)
            tr, cfg = Trace(names=["exp_ids"]), eng.cfg
            run = replay_golden(eng, golden, path, trace=tr)
        routed = [il for il in range(cfg.n_layer) if il >= cfg.n_hash_layer]     # the top-k layers
        ids = np.stack([tr.series("exp_ids", il)[1] for il in routed], axis=1)
        _FREE_RUNS[key] = golden, run_rows(run, path), ids
    return _FREE_RUNS[key]


def test_rebuild_data_reproduce_the_goldens_with_ds4s_own_flags(rebuilds):
    """The yardstick's harness is sound: built with ds4.c's Makefile flags it reproduces every golden row bit
    for bit (the one row a prefill produces to <= 1.5e-6, the code-generation effect data/oracle/README.md
    also reports for its instrumented build) and every recorded expert choice."""
    data, variants = rebuilds.data, rebuilds.variants
    assert len(variants) >= 5 and {"A", "C", "bundled", "trained"} <= set(REBUILD_CASES)
    for case, spec in REBUILD_CASES.items():
        golden = np.load(ROOT / spec["golden"])
        for path in ("batch", "stream"):
            key = f"{case}.{path}.golden"
            exact = data[f"{key}.bit_exact_rows"]
            assert exact[1:].all() and data[f"{key}.max_abs"][0] <= 1.5e-6
            assert np.array_equal(data[f"{key}.expert_ids"], golden[f"trace_{path}_expert_ids"])
            for v in variants:       # and every other build is chaotic in the same way as ds4ref
                assert not data[f"{case}.{path}.{v}.bit_exact_rows"].any()


def test_the_yardstick_refuses_a_run_past_it(rebuilds, golden_C):
    """The check can fail: ds4.c's golden rows are at distance 0; rows with one logit moved by 10 (the argmax
    of every row changed) are past every rebuild, and the error names the measure."""
    ref = golden_rows(golden_C, "batch")
    ok = rebuilds.check("C", "batch", golden_C, distance_to_golden(ref, golden_C, "batch"))
    assert set(ok) == {"1 - corr (worst row)", "mean |d| (worst row)", "mean |d| (median row)",
                       "max |d| (worst row)", "rows whose argmax differs"}
    bad = ref.copy()
    bad[np.arange(len(bad)), np.argmin(bad, -1)] += 30.0
    with pytest.raises(YardstickError, match="rows whose argmax differs 17 > "):
        rebuilds.check("C", "batch", golden_C, distance_to_golden(bad, golden_C, "batch"))


def test_the_yardstick_table_shows_each_measure_beside_the_furthest_rebuild(rebuilds, golden_C):
    """Rebuilds.table prints, per measure, ours in the masked bracket, the furthest rebuild's
    value (the max over the six rebuilds' own distances) and the limit (1.25 x it, counts
    also 1 + 2 sqrt); a run exactly at the furthest rebuild passes, one past a limit raises."""
    d = list(rebuilds.distances("C", "batch", golden_C).values())
    far = {k: max(x[k] for x in d) for k in d[0]}
    lines = rebuilds.table("C", "batch", golden_C, far).splitlines()
    assert lines[0].split()[:2] == ["measure", "ours"] and len(lines) == 1 + len(far)
    for line, (k, w) in zip(lines[1:], far.items()):
        count = k in COUNTS
        limit = 1.25 * w + (1 + 2 * np.sqrt(w) if count else 0)
        shown = (str(int(w)), f"<= {int(limit)}") if count else (f"{w:.4g}", f"<= {limit:.4g}")
        assert line.startswith(k) and "[measured" in line
        assert line.split("]")[1].split() == [shown[0], *shown[1].split()]
    over = dict(far, **{"mean |d| (worst row)": 1.3 * far["mean |d| (worst row)"]})
    with pytest.raises(YardstickError, match="mean \\|d\\| \\(worst row\\)"):
        rebuilds.table("C", "batch", golden_C, over)


@pytest.mark.parametrize("backend", ["numpy", "numba"])
@pytest.mark.parametrize("case", list(REBUILD_CASES))
@pytest.mark.parametrize("path", ["batch", "stream"])
def test_as_close_to_ds4c_as_ds4c_rebuilt_with_other_flags(case, path, backend, request, rebuilds):
    """The acceptance yardstick: free-running ds4ref (the numpy reference, and numba, the default backend on
    a CPU) is no further from ds4.c's golden logits and expert choices than ds4.c itself compiled with other
    flags (strict IEEE -O2, -O2 fast-math, AVX2, SSE2, no vectorizer, 512-bit vectors), within
    REBUILD_SLACK, on every measure: worst and median row, the expert choices, and the rows whose argmax (the
    greedy token) differs from ds4.c's."""
    golden, rows, ids = free_run(case, path, backend, request)
    ours = distance_to_golden(rows, golden, path, ids)
    limits = rebuilds.limits(case, path, golden)
    for k in ours:
        print(f"case {case} {path:6s} {backend:5s} {k:38s} ds4ref {ours[k]:8.4f}   limit {limits[k]:8.4f}")
    rebuilds.check(case, path, golden, ours)


RECORDED = ROOT / "book/results/oracle_ds4ref.npz"     # appendix A.5 reads it (tools/oracle_rows.py)


@pytest.mark.parametrize("case", list(REBUILD_CASES))
@pytest.mark.parametrize("path", ["batch", "stream"])
def test_appendix_a_recorded_replays_stand_where_a_fresh_replay_stands(case, path, request, rebuilds):
    """Appendix A.5 prints ds4ref's free replays of every case from book/results/oracle_ds4ref.npz
    instead of running them again. Here the same replay runs afresh: the record has the fresh run's
    rows and decisions (one per row of ds4.c's run), its per-row measures are logit_agreement's on
    the record's own argmax, and both the record and the fresh run stand within the rebuild
    yardstick on every measure (their digits move with the BLAS kernel, so no bit-for-bit compare)."""
    from ds4ref.dev.oracle import _distance
    rec = np.load(RECORDED)
    meta = json.loads(RECORDED.with_suffix(".json").read_text())
    assert meta["backend"] == "numpy" and set(meta["cases"]) == set(REBUILD_CASES)
    golden, rows, ids = free_run(case, path, "numpy", request)
    key = f"{case}.{path}.ds4ref"
    m = {k: rec[f"{key}.{k}"] for k in ("corr", "mean_abs", "max_abs")}
    fresh = logit_agreement(rows, golden_rows(golden, path))
    assert all(m[k].shape == fresh[k].shape == (len(rows),) for k in m)
    assert rec[f"{key}.argmax"].shape == (len(rows),) and rec[f"{key}.expert_ids"].shape == ids.shape
    assert ((0 <= m["mean_abs"]) & (m["mean_abs"] <= m["max_abs"]) & (m["corr"] <= 1)).all()
    recorded = _distance(m, rec[f"{key}.argmax"], golden, path, rec[f"{key}.expert_ids"])
    assert set(recorded) == set(distance_to_golden(rows, golden, path, ids))
    rebuilds.check(case, path, golden, recorded)
    rebuilds.check(case, path, golden, distance_to_golden(rows, golden, path, ids))


@pytest.mark.parametrize("forced", [False, True])
def test_appendix_a_recorded_shadow_decisions_stand_where_fresh_ones_stand(forced, runs_A, golden_A,
                                                                          rebuilds, oracle_dir):
    """Appendix A.5's decision figure reads case A batch's shadow decisions (free, and with ds4's
    forced) from book/results/oracle_ds4ref.npz: the record covers the layers and positions a fresh
    traced replay decides, and both stand within the decision yardstick, experts and indexer."""
    import sys
    sys.path.insert(0, str(ROOT / "tools"))
    from oracle_rows import shadow_decided
    rec = shadow_decided(np.load(RECORDED))[forced]
    fresh = runs_A["batch", forced]["decisions"]
    idx = Rebuilds(oracle_dir, "rebuilds_indexer")
    for kind, rb in (("experts", rebuilds), ("indexer", idx)):
        assert sorted(rec[kind]) == sorted(fresh[kind])
        assert all(rec[kind][il].shape == fresh[kind][il].shape for il in rec[kind])
        for d in (rec, fresh):
            claims = check_decisions(rb, "A", "batch", golden_A, stacked(d, kind), kind)
            assert set(claims) == set(EXPERT_MEASURES if kind == "experts" else INDEXER_MEASURES)


@pytest.mark.parametrize("case", ["A", "C"])
@pytest.mark.parametrize("path", ["batch", "stream"])
def test_expert_decisions_within_the_rebuild_yardstick(case, path, request, engine, rebuilds):
    """Free-running expert choices against ds4's, on the three decision measures of appendix A.5: the
    share of chosen experts not ds4's, the sets differing where ds4's margin is clear (> 1e-2) and where
    it is wide (> 0.05). Each is no further than ds4.c's own rebuilds' choices (rebuilds.npz) plus 25 %
    (a count also its noise): a free run's decisions flip with its rounding chaos, so a fixed share or
    margin met on one machine is not a criterion (ds4.c's rebuilds differ up to margin 0.078)."""
    runs, golden = request.getfixturevalue(f"runs_{case}"), request.getfixturevalue(f"golden_{case}")
    tr, cfg = runs[path, False]["trace"], engine.cfg
    routed = [il for il in range(cfg.n_layer) if il >= cfg.n_hash_layer]
    ours = np.stack([tr.series("exp_ids", il)[1] for il in routed], axis=1)     # [P+S, 3, 6]
    assert ours.shape == golden[f"trace_{path}_expert_ids"].shape
    claims = check_decisions(rebuilds, case, path, golden, ours, "experts")
    print(f"case {case} {path}: {claims}")
    assert set(claims) == set(EXPERT_MEASURES)


def _indexer_selected(tr, golden, path, cfg) -> np.ndarray:
    """The indexer's selected rows a run traced, [P+S, ratio-4 layers, top_k] (-1: kept every row)."""
    sel = golden[f"trace_{path}_indexer_selected"]
    indexed = [il for il in range(cfg.n_layer) if cfg.compress_ratio(il) == 4]
    out = np.full(sel.shape, -1, np.int32)
    for j, il in enumerate(indexed):
        for p in range(len(sel)):
            if f"L{il}.P{p}.idx_selected" in tr:
                out[p, j] = np.sort(tr[f"L{il}.P{p}.idx_selected"])
    return out


@pytest.mark.parametrize("path", ["batch", "stream"])
def test_indexer_decisions_within_the_rebuild_yardstick(path, runs_A, golden_A, engine, oracle_dir):
    """Selections happen exactly where ds4's do (n_comp > top_k: exact on any machine), and the
    selected row sets are no further from ds4's than the sets of ds4.c's rebuilds, plus 25 %, on the
    three decision measures (rows not ds4's, sets differing, sets differing where ds4's margin > 0.1;
    data/oracle/rebuilds_indexer.*: six builds of ds4.c patched to log the indexer; its AVX2 and SSE2
    builds gave rebuilds.npz's logits bit for bit). Not the largest margin at which a set differs: one
    FP4-rounded score swaps a row at margin 0.2-0.35 in ds4.c's own rebuilds, 0.3 in ds4ref."""
    tr, cfg = runs_A[path, False]["trace"], engine.cfg
    sel = golden_A[f"trace_{path}_indexer_selected"]
    ours = _indexer_selected(tr, golden_A, path, cfg)
    np.testing.assert_array_equal(ours[..., 0] < 0, sel[..., 0] < 0)
    assert (sel[..., 0] >= 0).sum() > 60
    claims = check_decisions(Rebuilds(oracle_dir, "rebuilds_indexer"), "A", path, golden_A, ours,
                             "indexer")
    print(f"{path}: {claims}")
    assert set(claims) == set(INDEXER_MEASURES)


# ------------------------------------------------- shadow decisions: our logic on ds4's forced path

@pytest.fixture(scope="module")
def forced_state_error(engine, runs_A, ops_A):
    """How close the forced stream run's state is to ds4's where decisions are made: max |ours - ds4|
    of the biased router scores (layers 3-5) and of the indexer scores (layers 2, 4) at ops_A's positions
    1..299 (ops_A records the stream path; its position 0 comes from a separate prefill run, README)."""
    pos = [int(p) for p in ops_A["positions"] if p > 0]
    tr = runs_A["stream", True]["trace"]
    cfg, W = engine.cfg, engine.weights
    err_r = max(float(np.abs(tr[f"L{il}.P{p}.router_biased"] - ops_A[f"L{il}.P{p}.router_biased"]).max())
                for il in (3, 4, 5) for p in pos)
    from ds4ref.indexer import indexer_allowed
    err_i, n = 0.0, 0
    for il in (2, 4):
        for p in pos:
            if f"L{il}.P{p}.idx_scores" not in ops_A.files:
                continue
            _, idx = indexer_allowed(cfg, W.layers[il], il, tr[f"L{il}.P{p}.attn_norm"], tr[f"L{il}.P{p}.qr_norm"],
                                     tr[f"L{il}.P{p}.cache_icomp"], p, NUMPY)
            err_i = max(err_i, float(np.abs(idx.scores - ops_A[f"L{il}.P{p}.idx_scores"]).max()))
            n += 1
    assert n >= 10
    print(f"forced state vs ds4 at ops_A positions: router score error {err_r:.4f}, indexer score error {err_i:.3f}")
    return err_r, err_i


def test_decision_logic_reproduces_ds4_choices_from_ds4_inputs(engine, ops_A):
    """The decision functions alone: ds4's recorded router probabilities and indexer inputs give exactly
    ds4's recorded expert ids (in order) and indexer selections, at all 17 ops_A positions."""
    from ds4ref.indexer import indexer_allowed
    from ds4ref.moe import topk_selected_experts
    cfg, W = engine.cfg, engine.weights
    n_idx = 0
    for p in ops_A["positions"]:
        for il in (3, 4, 5):
            ids = topk_selected_experts(ops_A[f"L{il}.P{p}.router_probs"], W.layers[il].ffn_exp_probs_b.numpy(), 6)
            assert ids.tolist() == ops_A[f"L{il}.P{p}.exp_ids"].tolist(), (il, p)
        for il in (2, 4):
            if f"L{il}.P{p}.idx_selected" in ops_A.files:
                allowed, _ = indexer_allowed(cfg, W.layers[il], il, ops_A[f"L{il}.P{p}.attn_norm"],
                                             ops_A[f"L{il}.P{p}.qr_norm"], ops_A[f"L{il}.P{p}.cache_icomp"], int(p),
                                             NUMPY)
                assert np.flatnonzero(allowed).tolist() == sorted(ops_A[f"L{il}.P{p}.idx_selected"].tolist())
                n_idx += 1
    assert n_idx >= 10


def test_forced_state_is_close_to_ds4s_where_decisions_are_made(forced_state_error):
    """With ds4's decisions replayed, our router scores stay within 0.06 of ds4's recorded ones
    (measured 0.037) and the FP4-rounded indexer scores within 0.6 (measured 0.39, on scores up to ~3).
    Fixed bounds are sound here: with every decision replayed the state drifts continuously by
    rounding, about as far under every setting of tools/check_portability.sh."""
    err_r, err_i = forced_state_error
    assert err_r <= 0.06 and err_i <= 0.6


@pytest.mark.parametrize("path", ["batch", "stream"])
def test_shadow_expert_decisions_differ_only_within_the_state_error(path, runs_A, golden_A, forced_state_error,
                                                                    rebuilds):
    """ds4's decisions forced, our own (shadow) choice computed at every position of case A: no expert set
    differs where ds4's margin exceeds 2 x the router score error (a swap needs |error_i - error_j| > margin;
    derived, so it holds wherever the measured error does); measured: worst differing margin 0.043 (batch)
    / 0.033 (stream) against 2 x 0.037. And the shadows, like the free run's choices, are within the rebuild
    yardstick's decision measures (the drift that flips them is rounding inside each token, not a cascade
    of decision flips)."""
    err_r, _ = forced_state_error
    margin = golden_A[f"trace_{path}_expert_margin"]
    shadow = decision_mismatches(runs_A[path, True]["decisions"], golden_A, path)["experts"]
    free = decision_mismatches(runs_A[path, False]["decisions"], golden_A, path)["experts"]
    clear = margin > DECISION_MARGIN
    worst = float(margin[shadow].max()) if shadow.any() else 0.0
    print(f"{path}: shadow expert sets differ above 1e-2: {int(shadow[clear].sum())}/{int(clear.sum())} "
          f"(free-running {int(free[clear].sum())}); worst differing margin {worst:.4f}, 2 x error {2 * err_r:.4f}")
    assert not shadow[margin > 2 * err_r].any()
    check_decisions(rebuilds, "A", path, golden_A, stacked(runs_A[path, True]["decisions"], "experts"),
                    "experts")
    np.testing.assert_array_equal(runs_A[path, False]["decisions"]["experts"][3],
                                  runs_A[path, False]["trace"].series("exp_ids", 3)[1])   # free: shadow = used


@pytest.mark.parametrize("path", ["batch", "stream"])
def test_shadow_indexer_decisions_differ_only_within_the_state_error(path, runs_A, golden_A, forced_state_error,
                                                                     oracle_dir):
    """ds4's decisions forced: the shadow indexer selects exactly where ds4 does (n_comp > top_k), no row
    set differs where ds4's margin exceeds 2 x the indexer score error (derived, as for the experts), and
    the sets are within the rebuild yardstick's decision measures (rebuilds_indexer.*)."""
    _, err_i = forced_state_error
    sel = golden_A[f"trace_{path}_indexer_selected"]
    margin = golden_A[f"trace_{path}_indexer_margin"]
    dec = runs_A[path, True]["decisions"]["indexer"]
    ours = np.stack([dec[il][:len(sel)] for il in sorted(dec)], axis=1)          # [P+S, 2, 16]
    np.testing.assert_array_equal(ours[..., 0] < 0, sel[..., 0] < 0)
    shadow = decision_mismatches(runs_A[path, True]["decisions"], golden_A, path)["indexer"]
    assert not shadow[margin > 2 * err_i].any()
    live = sel[..., 0] >= 0
    claims = check_decisions(Rebuilds(oracle_dir, "rebuilds_indexer"), "A", path, golden_A, ours, "indexer")
    print(f"{path}: shadow indexer sets differ {int(shadow[live].sum())}/{int(live.sum())}, worst margin "
          f"{float(np.nanmax(np.where(shadow, margin, np.nan))):.3f}; {claims}")


@pytest.mark.parametrize("case", ["A", "C"])
def test_greedy_tokens_where_ds4s_gap_is_wide(case, request, golden_json, rebuilds):
    """The greedy tokens (batch path, teacher-forced) at every step whose ds4 top1-top2 gap is >= 0.25
    (the oracle README's near-tie rule), held to the rebuild yardstick on those rows: no more tokens
    differing from ds4's than ds4.c's rebuilds have there, plus a count's noise (five of six rebuilds
    pick another token at one such step of case A), and every logit measure of those rows within it."""
    runs, golden = request.getfixturevalue(f"runs_{case}"), request.getfixturevalue(f"golden_{case}")
    gaps = golden_json["cases"][case]["greedy_top1_top2_gap"]
    ours = np.vstack([runs["batch", False]["prompt_logits"][None], runs["batch", False]["step_logits"]])
    n = len(golden["greedy_tokens"])
    np.testing.assert_array_equal(golden_rows(golden, "batch")[:n].argmax(1), golden["greedy_tokens"])
    wide = np.flatnonzero(np.array([gaps["prompt"]] + gaps["steps"])[:n] >= NEAR_TIE)
    assert len(wide) >= 1
    print(f"case {case}: {len(wide)} wide-gap steps:", rebuilds.check_rows(case, "batch", golden, ours[wide], wide))


def test_batch_and_stream_runs_agree_exactly_on_the_prompt(runs_A, runs_C):
    for runs in (runs_A, runs_C):
        np.testing.assert_array_equal(runs["batch", False]["prompt_logits"], runs["stream", False]["pos_logits"][-1])


def test_forced_decisions_bring_logits_closer(runs_A, golden_A, rebuilds):
    """With ds4's decisions replayed, the mean row distance to ds4.c (mean over rows of mean |d|) is below
    that of every free-running rebuild of ds4.c (measured 0.086 / 0.085 on the batch / stream path against
    the closest rebuilds' 0.092 / 0.104). A forced run drifts continuously, so its distance moves little by
    machine; the rebuilds' are fixed data. (Not against this machine's own free run: that one is chaotic.)"""
    for path in ("batch", "stream"):
        forced = logit_agreement(*_rows(runs_A[path, True], golden_A, path))["mean_abs"].mean()
        closest = min(rebuilds.data[f"A.{path}.{v}.mean_abs"].mean() for v in rebuilds.variants)
        assert forced < closest, (path, forced, closest)


def test_decisions_from_golden_layout(golden_A, engine):
    d = decisions_from_golden(golden_A, engine.cfg, "stream")
    assert sorted(d["experts"]) == [3, 4, 5] and sorted(d["indexer"]) == [2, 4]
    assert d["experts"][4].shape == (332, 6) and d["indexer"][2].shape == (332, 16)
    np.testing.assert_array_equal(d["experts"][5], golden_A["trace_stream_expert_ids"][:, 2])


# ---------------------------------------------------------------------------------- the session

PROMPT = [0, 511, 574, 370, 228, 17, 900, 33, 250, 1001, 42, 7]


@pytest.fixture(scope="module")
def fresh_logits(engine):
    """Fresh-session (batch prefill) logits for each prefix of PROMPT."""
    out = {}
    for n in (1, 4, 8, 12):
        s = engine.session(64)
        s.sync(PROMPT[:n])
        out[n] = s.logits.copy()
    return out


def test_sync_extension_decodes_only_the_suffix(engine):
    s = engine.session(64)
    assert s.sync(PROMPT[:8]) == 8
    assert s.sync(PROMPT[:8]) == 0            # nothing new
    assert s.sync(PROMPT) == 4                # extension: 4 decode steps
    t = engine.session(64)
    t.sync(PROMPT[:8])
    for tok in PROMPT[8:]:
        t.eval(tok)
    np.testing.assert_array_equal(s.logits, t.logits)
    assert s.pos == 12 and s.tokens == PROMPT and s.common_prefix(PROMPT[:5] + [3]) == 5


def test_sync_mismatch_rebuilds_like_a_fresh_session(engine, fresh_logits):
    s = engine.session(64)
    s.sync([0, 5, 6, 7, 8, 9])
    assert s.sync(PROMPT[:8]) == 8            # edited history: full rebuild
    np.testing.assert_array_equal(s.logits, fresh_logits[8])


def test_decode_path_equals_batch_prefill_bit_for_bit(engine, fresh_logits, golden_A):
    """ds4ref's two paths are the same function bit for bit (ds4.c's differ by float reordering)."""
    s = engine.session(256)
    s.sync(PROMPT[:1])
    np.testing.assert_array_equal(s.logits, fresh_logits[1])
    for tok in PROMPT[1:]:
        s.eval(tok)
    np.testing.assert_array_equal(s.logits, fresh_logits[12])


def test_rewind_equals_fresh_sync_of_the_prefix(engine, fresh_logits):
    s = engine.session(64)
    s.sync(PROMPT)
    s.rewind(8)
    assert s.tokens == PROMPT[:8]
    np.testing.assert_array_equal(s.logits, fresh_logits[8])
    s.rewind(0)
    assert s.pos == 0 and s.tokens == []
    with pytest.raises(NoLogitsError):
        s.logits
    with pytest.raises(SessionError, match="rewind"):
        s.rewind(3)


def test_snapshot_restore_and_file_round_trip(engine, tmp_path):
    s = engine.session(64)
    s.sync(PROMPT[:8])
    snap = s.snapshot()
    s.eval(PROMPT[8])
    after = s.logits.copy()
    s.save(tmp_path / "s.npz")
    s.restore(snap)
    assert s.tokens == PROMPT[:8]
    s.eval(PROMPT[8])
    np.testing.assert_array_equal(s.logits, after)
    t = engine.session(64)
    t.load(tmp_path / "s.npz")
    assert t.tokens == PROMPT[:9]
    np.testing.assert_array_equal(t.logits, after)
    t.eval(PROMPT[9])
    s.eval(PROMPT[9])
    np.testing.assert_array_equal(t.logits, s.logits)
    with pytest.raises(SessionError, match="ctx_size"):
        engine.session(128).load(tmp_path / "s.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a session")
    with pytest.raises(SessionError, match="not a ds4ref session"):
        t.load(tmp_path / "junk.npz")


def test_bad_input_raises_named_errors_and_session_stays_usable(engine):
    s = engine.session(16)
    s.sync(PROMPT[:4])
    before = s.logits.copy()
    with pytest.raises(EmptyPromptError):
        s.sync([])
    with pytest.raises(TokenRangeError):
        s.sync([0, 5, 1024])
    with pytest.raises(TokenRangeError):
        s.sync([0, -1])
    with pytest.raises(TokenRangeError):
        s.eval(4096)
    with pytest.raises(TokenRangeError):
        s.eval(2.5)
    with pytest.raises(ContextOverflowError):
        s.sync(list(range(16)))
    with pytest.raises(SamplingError):
        s.sample(temperature=-1.0, rng=SampleRNG(1))
    with pytest.raises(SamplingError):
        s.sample(temperature=1.0, top_p=1.5, rng=SampleRNG(1))
    with pytest.raises(SessionError):
        s.top_logprobs(0)
    with pytest.raises(SessionError):
        engine.session(1)
    with pytest.raises(ContextOverflowError, match="GiB"):
        engine.session(10**11)
    assert s.tokens == PROMPT[:4]
    np.testing.assert_array_equal(s.logits, before)
    for t in range(11):
        s.eval(t)
    with pytest.raises(ContextOverflowError):
        s.eval(3)                              # 15 tokens held: a 16th would fill ctx 16
    assert s.pos == 15
    assert s.sync(PROMPT[:4]) == 4            # still usable: rebuilds
    np.testing.assert_array_equal(s.logits, before)


def test_failed_forward_invalidates_checkpoint(engine, monkeypatch):
    s = engine.session(64)
    s.sync(PROMPT[:4])

    def boom(*a, **k):
        raise RuntimeError("simulated failure inside the forward pass")
    monkeypatch.setattr(engine.model, "hidden", boom)
    with pytest.raises(RuntimeError):
        s.eval(5)
    monkeypatch.undo()
    assert s.pos == 0 and s.tokens == []
    assert s.sync(PROMPT[:4]) == 4


def test_argmax_sample_and_top_logprobs(engine):
    s = engine.session(64)
    s.sync(PROMPT[:4])
    v = s.logits.astype(np.float64)
    logp = v - (v.max() + np.log(np.exp(v - v.max()).sum()))
    top = s.top_logprobs(5)
    assert [i for i, _, _ in top] == np.argsort(-v, kind="stable")[:5].tolist()
    for i, logit, lp in top:
        assert logit == s.logits[i] and abs(lp - logp[i]) < 1e-5
    assert s.argmax() == top[0][0] == s.sample(0.0)
    a = [s.sample(1.0, 40, 0.9, 0.05, r) for r in [SampleRNG(9)] for _ in range(20)]
    b = [s.sample(1.0, 40, 0.9, 0.05, r) for r in [SampleRNG(9)] for _ in range(20)]
    assert a == b


def test_trace_keys_match_ops_names(engine, ops_A, golden_A, rebuilds):
    """A decode of token 0 at position 0 (ops_A's P0 run) captures ds4's op names at their keys; the
    layer-0 attention values equal ds4's up to the heads (float noise); the logits, after three routed
    layers whose choices may flip, are within the rebuild yardstick of ds4's first stream row (ds4ref's
    decode and prefill give the same bits; ds4.c's own decode path at P0, which ops_A records, is 0.55
    from its prefill)."""
    tr = Trace(positions=[0])
    s = engine.session(64)
    s.trace = tr
    s.eval(int(ops_A["P0.token"][0]))
    core = ["hc_in", "attn_norm", "qr_norm", "q_rope", "kv_stored", "cache_raw", "heads", "heads_unrope",
            "attn_out", "after_attn_hc", "ffn_norm", "router_probs", "exp_ids", "exp_mid", "moe_out",
            "shared_out", "hc_out"]
    for il in range(engine.cfg.n_layer):
        for name in core:
            assert f"L{il}.P0.{name}" in tr and f"L{il}.P0.{name}" in ops_A.files, (il, name)
    for name in ("token", "embd", "out_hc_mix", "out_hc_w", "out_embd", "out_norm", "logits"):
        assert f"P0.{name}" in tr and tr[f"P0.{name}"].shape == ops_A[f"P0.{name}"].shape, name
    for name in ("hc_in", "attn_norm", "q_rope", "kv_stored", "heads_unrope"):
        np.testing.assert_allclose(tr[f"L0.P0.{name}"], ops_A[f"L0.P0.{name}"], rtol=1e-5, atol=2e-6)
    assert golden_A["prompt_ids"][0] == ops_A["P0.token"][0]
    rebuilds.check_rows("A", "stream", golden_A, tr["P0.logits"][None], [0])


def test_output_head_matches_ds4c_ops(engine, ops_A):
    """Feed ds4's recorded final HC state into our output head: logits as ds4.c's."""
    from ds4ref.model import output_logits
    for p in ops_A["positions"]:
        logits, head = output_logits(engine.cfg, engine.weights, ops_A[f"L5.P{p}.hc_out"], NUMPY)
        for name, v in zip(("out_hc_mix", "out_hc_w", "out_embd", "out_norm"), head):
            np.testing.assert_allclose(v, ops_A[f"P{p}.{name}"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(logits, ops_A[f"P{p}.logits"], rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------- property test (Hypothesis)

@pytest.fixture(scope="module")
def small_engine(tmp_path_factory):
    """A very small DS4 model: 3 layers (dense, dense, ratio 4 + indexer top 2), SWA window 8."""
    from ds4ref.config import ModelConfig
    from ds4ref.dev.writer import write_model
    cfg = dataclasses.replace(ModelConfig.tiny(), n_layer=3, compress_ratios=(0, 0, 4), n_swa=8,
                              indexer_top_k=2)
    path = write_model(tmp_path_factory.mktemp("small") / "small.gguf", cfg, seed=3)
    return Engine.open(path, backend="numpy")


ops = st.lists(st.one_of(
    st.tuples(st.just("sync_extend"), st.lists(st.integers(2, 1023), min_size=1, max_size=8)),
    st.tuples(st.just("sync_new"), st.lists(st.integers(2, 1023), min_size=1, max_size=16)),
    st.tuples(st.just("eval"), st.integers(2, 1023)),
    st.tuples(st.just("rewind"), st.integers(0, 30)),
    st.tuples(st.just("snapshot"), st.none()),
    st.tuples(st.just("restore"), st.none()),
    st.tuples(st.just("save_load"), st.none()),
), min_size=1, max_size=8)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops)
def test_session_operations_equal_a_fresh_prefill(small_engine, program):
    """After any mix of sync / eval / rewind / snapshot-restore / save-load, the logits are exactly those
    of a fresh session that prefills the same tokens; a refused operation changes nothing."""
    s = small_engine.session(48)
    snap = None
    for op, arg in program:
        before = (s.tokens, None if s.pos == 0 else s.logits.copy())
        try:
            if op == "sync_extend":
                s.sync(([0] if not s.tokens else s.tokens) + arg)
            elif op == "sync_new":
                s.sync([0] + arg)
            elif op == "eval":
                s.eval(arg)
            elif op == "rewind":
                s.rewind(min(arg, s.pos))
            elif op == "snapshot":
                snap = s.snapshot()
            elif op == "restore" and snap is not None:
                s.restore(snap)
            elif op == "save_load":
                with tempfile.TemporaryDirectory() as d:
                    s.save(Path(d) / "s.npz")
                    s = small_engine.session(48)
                    s.load(Path(d) / "s.npz")
        except ContextOverflowError:
            assert s.tokens == before[0]
            if before[1] is not None:
                np.testing.assert_array_equal(s.logits, before[1])
    if s.pos == 0:
        return
    fresh = small_engine.session(48)
    fresh.sync(s.tokens)
    np.testing.assert_array_equal(s.logits, fresh.logits, err_msg=str(program))


# ------------------------------------------------------------------------------------------- CLI

def test_cli_generates_and_reports_speeds(oracle_gguf):
    r = subprocess.run([sys.executable, "-m", "ds4ref", "-m", str(oracle_gguf), "-p", "Hello", "-n", "4",
                        "--temp", "0", "--no-progress"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "prefill:" in r.stderr and "decode:" in r.stderr and "tok/s" in r.stderr
    assert len(r.stdout) > 0
    # a first run with no --backend: 'auto' picks numba on a CPU and says why (issue 11)
    assert r.stderr.startswith("backend: numba (auto: CPU; numba is verified against ds4.c's oracle on CPUs")


def test_cli_greedy_output_equals_session_argmax(oracle_gguf, engine):
    from ds4ref.__main__ import main
    import contextlib
    import io
    buf, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
        assert main(["-m", str(oracle_gguf), "-p", "hi", "-n", "3", "--temp", "0", "--no-progress",
                     "--backend", "numpy"]) == 0                  # the same backend as `engine`
    tok = engine.tokenizer
    s = engine.session(1024)
    s.sync(tok.chat_prompt("hi", "You are a helpful assistant", "high"))
    ids = []
    for _ in range(3):
        t = s.argmax()
        if t == tok.eos_id:
            break
        ids.append(t)
        s.eval(t)
    assert buf.getvalue() == tok.decode(ids) + "\n"


def test_cli_warm_weights_touches_the_pages_and_changes_nothing_else(oracle_gguf, monkeypatch, capsys):
    from ds4ref.__main__ import main
    from ds4ref.gguf import GGUFFile
    calls, real = [], GGUFFile.warm_pages
    monkeypatch.setattr(GGUFFile, "warm_pages", lambda self: calls.append(real(self)) or calls[-1])
    args = ["-m", str(oracle_gguf), "-p", "hi", "-n", "3", "--temp", "0", "--no-progress"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert calls == [] and main(args + ["--warm-weights"]) == 0
    assert capsys.readouterr().out == plain and len(calls) == 1 and calls[0] > 3000


def test_cli_rejects_bad_input_with_a_message(oracle_gguf, tmp_path, capsys):
    from ds4ref.__main__ import main
    assert main(["-m", str(oracle_gguf), "--top-p", "0", "-n", "1"]) == 2
    assert main(["-m", str(oracle_gguf), "--temp", "-1", "-n", "1"]) == 2
    assert main(["-m", str(oracle_gguf), "--ctx", "8", "-n", "1", "--no-progress"]) == 2     # prompt > ctx
    assert main(["-m", str(tmp_path / "missing.gguf"), "-n", "1"]) == 2
    assert main(["-m", str(oracle_gguf), "--backend", "nosuch", "-n", "1"]) == 2
    err = capsys.readouterr().err
    assert "top_p" in err and "temperature" in err and "ctx_size 8" in err and "missing.gguf" in err


def test_engine_open_unknown_backend(oracle_gguf):
    from ds4ref.engine import BackendError
    with pytest.raises(BackendError, match="nosuch"):
        Engine.open(oracle_gguf, backend="nosuch")


def test_cli_summary_prints_the_model_shape(oracle_gguf, capsys):
    from ds4ref.__main__ import main
    assert main(["--summary", "-m", str(oracle_gguf)]) == 0
    out = capsys.readouterr().out
    assert "6 layers" in out and "vocab 1024" in out


def test_package_exports_engine_lazily():
    import ds4ref
    assert ds4ref.Engine is Engine and ds4ref.Trace is Trace
    with pytest.raises(AttributeError):
        ds4ref.NoSuchThing


# --------------------------------------------------------------------- sessions of one engine from two threads

def test_two_sessions_from_two_threads_give_what_they_give_one_after_the_other(oracle_gguf, oracle_dir, golden_A):
    """A session's trace, decisions and steering travel with its calls, never on the model the engine shares: two
    sessions of one steered engine, one replaying ds4.c's decisions with a trace and one plain, stepped in lock step
    from two threads, give the logits and the trace each gives alone."""
    import threading
    from ds4ref.dev.oracle import decisions_from_golden
    eng = Engine.open(oracle_gguf, backend="numpy", steering_file=oracle_dir / "ds4c_steering_dirs.f32",
                      steering_attn=0.5, steering_ffn=1.0)
    prompt = [int(t) for t in golden_A["prompt_ids"][:72]]
    steps = [int(t) for t in golden_A["greedy_tokens"][:4]]
    force = decisions_from_golden(golden_A, eng.cfg, "batch")

    def run(forced: bool, barrier=None):
        s = eng.session(128, force_decisions=force if forced else None)
        s.trace = Trace(positions=range(0, 80, 5)) if forced else NO_TRACE
        calls = [lambda: s.sync(prompt)] + [lambda t=t: s.eval(t) for t in steps]
        rows = []
        for call in calls:
            if barrier is not None:
                barrier.wait()
            call()
            rows.append(s.logits.copy())
        return np.stack(rows), dict(getattr(s.trace, "data", {}))

    alone = [run(True), run(False)]
    assert not np.array_equal(alone[0][0], alone[1][0])        # the decisions (and the trace) make a difference
    assert len(alone[0][1]) > 1000 and not alone[1][1]
    barrier, out, errors = threading.Barrier(2), [None, None], []

    def worker(i):
        try:
            out[i] = run(i == 0, barrier)
        except BaseException as exc:                            # surfaced below, not lost in the thread
            errors.append(exc)
            barrier.abort()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for (rows_alone, trace_alone), (rows_both, trace_both) in zip(alone, out):
        assert np.array_equal(rows_alone, rows_both)
        assert trace_alone.keys() == trace_both.keys()
        assert all(np.array_equal(trace_alone[k], trace_both[k]) for k in trace_alone)

"""The whole model against ds4.c, end to end; the session API; the CLI.

The oracle runs (case A: 300-token prompt + 32 steps, on both ds4 paths, with and without ds4's
decisions replayed) are computed once per module and shared by the tests below.
"""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds4ref.engine import (ContextOverflowError, EmptyPromptError, Engine, NoLogitsError, SessionError,
                           TokenRangeError, decisions_from_golden, logit_agreement, replay_golden)
from ds4ref.sample import SampleRNG, SamplingError
from ds4ref.trace import Trace

LOOSE = dict(corr=0.98, mean_abs=0.3, max_abs=1.5)          # data/oracle/README.md "How to compare" 3
DECISION_MARGIN = 1e-2                                       # README 2: above this a mismatch is a bug
NEAR_TIE = 0.25                                              # README 4: greedy compare up to this gap
ORACLE_TRACE = ["exp_ids", "idx_selected"]


@pytest.fixture(scope="module")
def engine(oracle_gguf):
    return Engine.open(oracle_gguf)


def _runs(engine, golden):
    out = {}
    for path in ("batch", "stream"):
        for forced in (False, True):
            tr = Trace(names=ORACLE_TRACE) if not forced else None
            out[path, forced] = replay_golden(engine, golden, path, forced, trace=tr)
            out[path, forced]["trace"] = tr
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


def _assert_loose(ours, ref, what):
    m = logit_agreement(ours, ref)
    worst = {k: (float(v.min()) if k == "corr" else float(v.max())) for k, v in m.items()}
    assert worst["corr"] >= LOOSE["corr"], (what, worst)
    assert worst["mean_abs"] <= LOOSE["mean_abs"], (what, worst)
    assert worst["max_abs"] <= LOOSE["max_abs"], (what, worst)
    return worst


@pytest.mark.parametrize("case", ["A", "C"])
@pytest.mark.parametrize("path", ["batch", "stream"])
@pytest.mark.parametrize("forced", [False, True])
def test_logits_match_ds4c_oracle_every_row(case, path, forced, request):
    runs, golden = request.getfixturevalue(f"runs_{case}"), request.getfixturevalue(f"golden_{case}")
    ours, ref = _rows(runs[path, forced], golden, path)
    worst = _assert_loose(ours, ref, f"case {case} {path} forced={forced}")
    print(f"case {case} {path:6s} forced={forced!s:5s} rows={len(ours)} worst: {worst}")


@pytest.mark.parametrize("case", ["A", "C"])
@pytest.mark.parametrize("path", ["batch", "stream"])
def test_expert_decisions_match_ds4c_where_margin_is_clear(case, path, request, engine):
    runs, golden = request.getfixturevalue(f"runs_{case}"), request.getfixturevalue(f"golden_{case}")
    tr, cfg = runs[path, False]["trace"], engine.cfg
    ids, margin = golden[f"trace_{path}_expert_ids"], golden[f"trace_{path}_expert_margin"]
    routed = [il for il in range(cfg.n_layer) if il >= cfg.n_hash_layer]
    checked = bad = 0
    for j, il in enumerate(routed):
        pos, ours = tr.series("exp_ids", il)
        assert pos.tolist() == list(range(len(ids)))
        for p in range(len(ids)):
            if margin[p, j] > DECISION_MARGIN:
                checked += 1
                bad += set(ours[p].tolist()) != set(ids[p, j].tolist())
    assert checked > 0.5 * len(ids) * len(routed)
    assert bad == 0, f"{bad} of {checked} clear-margin expert decisions differ"


@pytest.mark.parametrize("path", ["batch", "stream"])
def test_indexer_decisions_match_ds4c_where_margin_is_clear(path, runs_A, golden_A, engine):
    tr, cfg = runs_A[path, False]["trace"], engine.cfg
    sel, margin = golden_A[f"trace_{path}_indexer_selected"], golden_A[f"trace_{path}_indexer_margin"]
    indexed = [il for il in range(cfg.n_layer) if cfg.compress_ratio(il) == 4]
    checked = bad = 0
    for j, il in enumerate(indexed):
        for p in range(len(sel)):
            key = f"L{il}.P{p}.idx_selected"
            if sel[p, j, 0] < 0:
                assert key not in tr, f"{key}: we selected rows where ds4 kept all"
                continue
            assert key in tr, f"{key}: ds4 selected rows, we did not"
            if margin[p, j] > DECISION_MARGIN:
                checked += 1
                bad += set(tr[key].tolist()) != set(sel[p, j].tolist())
    assert checked > 100
    assert bad == 0, f"{bad} of {checked} clear-margin indexer selections differ"


@pytest.mark.parametrize("case", ["A", "C"])
def test_greedy_tokens_up_to_first_near_tie(case, request, golden_json):
    runs, golden = request.getfixturevalue(f"runs_{case}"), request.getfixturevalue(f"golden_{case}")
    gaps = golden_json["cases"][case]["greedy_top1_top2_gap"]
    ours = np.vstack([runs["batch", False]["prompt_logits"][None], runs["batch", False]["step_logits"]])
    gap_list = [gaps["prompt"]] + gaps["steps"]
    n = 0
    while n < len(gap_list) and gap_list[n] >= NEAR_TIE and n < len(golden["greedy_tokens"]):
        assert int(np.argmax(ours[n])) == int(golden["greedy_tokens"][n]), f"greedy token {n}"
        n += 1
    assert n >= 1


def test_forced_decisions_bring_logits_closer(runs_A, golden_A):
    for path in ("batch", "stream"):
        free = logit_agreement(*_rows(runs_A[path, False], golden_A, path))
        forced = logit_agreement(*_rows(runs_A[path, True], golden_A, path))
        assert forced["mean_abs"].mean() <= free["mean_abs"].mean() + 1e-3, path


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


def test_decode_path_agrees_with_batch_prefill_early(engine, fresh_logits):
    s = engine.session(64)
    s.sync(PROMPT[:1])
    np.testing.assert_array_equal(s.logits, fresh_logits[1])
    for tok in PROMPT[1:4]:
        s.eval(tok)
    m = logit_agreement(s.logits, fresh_logits[4])
    assert m["max_abs"] < 0.05 and m["corr"] > 0.9999, m


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
    import ds4ref.engine as E
    s = engine.session(64)
    s.sync(PROMPT[:4])

    def boom(*a, **k):
        raise RuntimeError("simulated failure inside the forward pass")
    monkeypatch.setattr(E, "forward_token", boom)
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


def test_trace_keys_match_ops_names(engine, ops_A):
    tr = Trace(positions=[0])
    s = engine.session(64)
    s.trace = tr
    s.eval(int(ops_A["P0.token"][0]))          # position 0 through the decode path, as ops_A's P0
    missing = [k for k in ops_A.files if k.startswith(("P0.", "L0.P0.", "L5.P0.")) and k not in tr
               and not k.startswith(("P0.q8", "L0.P0.q8", "L5.P0.q8"))]
    assert len(missing) <= 8, missing
    np.testing.assert_allclose(tr["P0.logits"], ops_A["P0.logits"], rtol=0, atol=2e-3)
    np.testing.assert_allclose(tr["L0.P0.after_attn_hc"], ops_A["L0.P0.after_attn_hc"], rtol=1e-5, atol=1e-5)


def test_output_head_matches_ds4c_ops(engine, ops_A):
    """Feed ds4's recorded final HC state into our output head: logits as ds4.c's."""
    from ds4ref.model import output_logits
    for p in ops_A["positions"]:
        tr = Trace()
        logits = output_logits(engine.cfg, engine.weights, ops_A[f"L5.P{p}.hc_out"], trace=tr.at(None, p))
        for name in ("out_hc_mix", "out_hc_w", "out_embd", "out_norm"):
            np.testing.assert_allclose(tr[f"P{p}.{name}"], ops_A[f"P{p}.{name}"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(logits, ops_A[f"P{p}.logits"], rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------- property test (Hypothesis)

@pytest.fixture(scope="module")
def small_engine(tmp_path_factory):
    """A very small DS4 model: 3 layers (dense, dense, ratio 4 + indexer top 2), SWA window 8."""
    from ds4ref.config import ModelConfig
    from ds4ref.writer import write_model
    cfg = dataclasses.replace(ModelConfig.tiny(), n_layer=3, compress_ratios=(0, 0, 4), n_swa=8,
                              indexer_top_k=2)
    path = write_model(tmp_path_factory.mktemp("small") / "small.gguf", cfg, seed=3)
    return Engine.open(path)


ops = st.lists(st.one_of(
    st.tuples(st.just("sync_extend"), st.lists(st.integers(2, 1023), min_size=1, max_size=4)),
    st.tuples(st.just("sync_new"), st.lists(st.integers(2, 1023), min_size=1, max_size=6)),
    st.tuples(st.just("eval"), st.integers(2, 1023)),
    st.tuples(st.just("rewind"), st.integers(0, 30)),
    st.tuples(st.just("snapshot"), st.none()),
    st.tuples(st.just("restore"), st.none()),
), min_size=1, max_size=6)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops)
def test_session_operations_equal_a_fresh_prefill(small_engine, program):
    s = small_engine.session(40)
    snap = None
    for op, arg in program:
        if op == "sync_extend":
            s.sync(([0] if not s.tokens else s.tokens) + arg)
        elif op == "sync_new":
            s.sync([0] + arg)
        elif op == "eval":
            if s.pos:
                s.eval(arg)
        elif op == "rewind":
            s.rewind(min(arg, s.pos))
        elif op == "snapshot":
            snap = s.snapshot()
        elif op == "restore" and snap is not None:
            s.restore(snap)
    if s.pos == 0:
        return
    fresh = small_engine.session(40)
    fresh.sync(s.tokens)
    m = logit_agreement(s.logits, fresh.logits)
    assert m["max_abs"] < 0.05 and m["corr"] > 0.9999, (program, m)
    assert s.argmax() == fresh.argmax() or m["max_abs"] < 1e-3


# ------------------------------------------------------------------------------------------- CLI

def test_cli_generates_and_reports_speeds(oracle_gguf):
    r = subprocess.run([sys.executable, "-m", "ds4ref", "-m", str(oracle_gguf), "-p", "Hello", "-n", "4",
                        "--temp", "0", "--no-progress"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "prefill:" in r.stderr and "decode:" in r.stderr and "tok/s" in r.stderr
    assert len(r.stdout) > 0


def test_cli_greedy_output_equals_session_argmax(oracle_gguf, engine):
    from ds4ref.__main__ import main
    import contextlib
    import io
    buf, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
        assert main(["-m", str(oracle_gguf), "-p", "hi", "-n", "3", "--temp", "0", "--no-progress"]) == 0
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


def test_cli_rejects_bad_sampling_flags(oracle_gguf):
    from ds4ref.__main__ import main
    assert main(["-m", str(oracle_gguf), "--top-p", "0", "-n", "1"]) == 2
    assert main(["-m", str(oracle_gguf), "--temp", "-1", "-n", "1"]) == 2


def test_engine_open_unknown_backend(oracle_gguf):
    from ds4ref.engine import BackendError
    with pytest.raises(BackendError, match="nosuch"):
        Engine.open(oracle_gguf, backend="nosuch")

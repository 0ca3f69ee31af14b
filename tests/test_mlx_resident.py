"""Chapter 09's MLX backend on device arrays (MlxDevice: chapter 8's Model with every
array in MLX): op-level results on ds4.c's ops_A, end-to-end agreement with ds4.c within
the rebuild yardstick, the count of host<->device transfers per forward call (MLX on the
CPU here), and that the resident engine runs the same model code as numpy."""
from __future__ import annotations

import sys

import numpy as np
import pytest

pytest.importorskip("mlx.core")

from _helpers import rel  # noqa: E402

from ds4ref.backend import NUMPY, BackendError, Placed  # noqa: E402
from ds4ref.backends.mlx_backend import MlxBackend, MlxDevice  # noqa: E402
from ds4ref.dev.mlx_transfers import TransferCounter  # noqa: E402
from ds4ref.engine import Engine  # noqa: E402
from ds4ref.hc import HyperConnection  # noqa: E402
from ds4ref.kvcache import KVCache  # noqa: E402
from ds4ref.model import Model  # noqa: E402
from ds4ref.moe import MoE  # noqa: E402
from ds4ref.trace import Trace  # noqa: E402

LAYERS = range(6)


@pytest.fixture(scope="module")
def dev():
    return MlxBackend(device="cpu").on_device()


@pytest.fixture(scope="module")
def engine(oracle_gguf):
    return Engine.open(oracle_gguf, backend=MlxBackend(device="cpu"), resident=True,
                       ctx_size=256)


def _np(x):
    return np.array(x)


def test_weights_stay_quantized(dev, model):
    cfg, W = model
    mx = dev.mx
    q = dev.place(W.layers[0].attn_q_a)
    assert isinstance(q, Placed) and q.data[0].dtype == mx.int8     # Q8_0 codes
    g = dev.place(W.layers[0].ffn_gate_exps)
    assert g.data.dtype == mx.uint8                                 # raw IQ2_XXS blocks
    assert g.data.shape == (cfg.n_expert, cfg.n_ff_exp, cfg.n_embd // 256, 66)
    assert dev.place(W.layers[0].ffn_down_exps).data.shape[-1] == 84   # raw Q2_K blocks
    assert dev.place(W.layers[0].hc_attn_fn).data.dtype == mx.float16
    assert dev.place(W.layers[0].attn_q_a) is q                     # placed once
    # the device holds the file's tensors (Q8_0 scales as f32: +2 bytes per 34), no more
    for t in (W.layers[0].attn_q_a, W.layers[0].ffn_gate_exps, W.layers[0].hc_attn_fn):
        p = dev.place(t)
        held = sum(a.nbytes for a in (p.data if isinstance(p.data, tuple) else [p.data]))
        assert t.data.nbytes <= held < 1.1 * t.data.nbytes


def test_ops_on_ops_A(dev, ops_A, positions, model):
    """The device glue and kernels on ds4.c's recorded inputs: codes exact, floats
    within 2e-6; the whole FFN sub-layer from ds4.c's input within 1e-2."""
    cfg, W = model
    mx = dev.mx
    worst = {}

    def note(name, err):
        worst[name] = max(worst.get(name, 0.0), err)

    for p in positions:
        for il in LAYERS:
            K = f"L{il}.P{p}."
            lw, ratio = W.layers[il], cfg.compress_ratio(il)
            a = dev.quantize_q8_0(mx.array(ops_A[K + "attn_norm"]))
            assert np.array_equal(_np(a.qs), ops_A[K + "q8.attn_q_a.qs"])
            note("q8_0 d", rel(_np(a.d), ops_A[K + "q8.attn_q_a.d"]))
            k = dev.quantize_q8_K(mx.array(ops_A[K + "ffn_norm"]))
            assert np.array_equal(_np(k.qs), ops_A[K + "q8k.ffn_gate_up_exps.qs"])
            assert np.array_equal(_np(k.bsums), ops_A[K + "q8k.ffn_gate_up_exps.bsums"])
            note("q8_K d", rel(_np(k.d), ops_A[K + "q8k.ffn_gate_up_exps.d"]))
            qb = dev.project(dev.place(lw.attn_q_b), mx.array(ops_A[K + "qr_norm"]))
            note("Q8_0 matvec", rel(_np(qb), ops_A[K + "q_b"].reshape(-1)))
            hc = HyperConnection(cfg, dev.place(lw.hc_attn_fn),
                                 dev.place(lw.hc_attn_scale), dev.place(lw.hc_attn_base),
                                 dev)
            x, post, comb = hc.pre(mx.array(ops_A[K + "hc_in"])[None])
            note("hc_pre", max(rel(_np(x[0]), ops_A[K + "attn_x"]),
                               rel(_np(post[0]), ops_A[K + "attn_post"]),
                               rel(_np(comb[0]), ops_A[K + "attn_comb"])))
            kv = dev.rope(mx.array(ops_A[K + "kv_normed"]), p, cfg, ratio)
            note("rope", rel(_np(kv), ops_A[K + "kv_rope"]))
            note("fp8_kv", rel(_np(dev.fp8_kv(mx.array(ops_A[K + "kv_rope"]), cfg.n_rot)),
                               ops_A[K + "kv_fp8"]))
            if K + "idx_q_rope" in ops_A:
                note("indexer_qat", rel(_np(dev.indexer_qat(
                    mx.array(ops_A[K + "idx_q_rope"]))), ops_A[K + "idx_q"]))
            ffn = MoE(cfg, lw, dev)
            tok = mx.array(ops_A[f"P{p}.token"].astype(np.int32))
            out = ffn(mx.array(ops_A[K + "after_attn_hc"])[None], tok, p)
            note("ffn sub-layer", rel(_np(out[0]), ops_A[K + "hc_out"]))
    print({k: f"{v:.1e}" for k, v in worst.items()})
    for name in ("q8_0 d", "q8_K d", "fp8_kv"):
        assert worst[name] == 0.0, (name, worst[name])
    for name in ("Q8_0 matvec", "hc_pre", "rope", "indexer_qat"):
        assert worst[name] < 2e-6, (name, worst[name])
    # one sub-layer on ds4's recorded input: no expert choice can flip (ds4's margins at these
    # positions are >= 0.014, the router's error here ~1e-6), so within 1e-5 unless an int8 code
    # moves (a half-step tie), which moves the output by far less than 1e-2
    assert worst["ffn sub-layer"] < 1e-2


@pytest.mark.parametrize("path", ["batch", "stream"])
def test_resident_replay_is_as_close_to_ds4c_as_its_rebuilds(path, oracle_dir):
    """ds4.c's "bundled" case (the seed-7 model, a 160-token prompt and 16 greedy steps,
    past the ratio-128 emission at pos 127 and the indexer's top-k selections) through the
    resident engine: every logit measure within the rebuild yardstick, one upload per
    forward call (the batch path: the whole prompt in one) and one download per logit
    row. (The expert measure needs a trace, whose downloads this count would see; the
    trace test below records on the device.)"""
    from ds4ref.dev.oracle import Rebuilds, distance_to_golden, replay_golden, run_rows
    from ds4ref.dev.writer import synthetic_model_path
    golden = np.load(oracle_dir / "ds4c_bundled.npz")
    eng = Engine.open(synthetic_model_path(), backend=MlxBackend(device="cpu"),
                      resident=True, ctx_size=192)
    eng.session(8).sync([1])                        # the RoPE rows go up on first use
    with TransferCounter() as c:
        run = replay_golden(eng, golden, path, ctx_size=192)
    rows = run_rows(run, path)
    calls = len(rows) if path == "stream" else 1 + len(run["step_logits"])
    assert (c.up, c.down, c.evals) == (calls, len(rows), calls)
    Rebuilds(oracle_dir).check("bundled", path, golden,
                               distance_to_golden(rows, golden, path))


def test_cache_rows_follow_chapter_6s_cache(model, dev):
    """130 tokens (past the ratio-128 emission at pos 127 and the indexer's first
    selections): the device cache holds as many raw, compressed and indexer rows per layer
    as chapter 6's cache after the same tokens."""
    cfg, W = model
    toks = np.random.default_rng(3).integers(0, cfg.n_vocab, 130)
    ref_cache, cache = KVCache(cfg, 320), KVCache(cfg, 320, dev.xp)
    ours, ref = Model(cfg, W, dev), Model(cfg, W, NUMPY)
    for pos, t in enumerate(toks):
        ours([int(t)], cache, pos)
        ref([int(t)], ref_cache, pos)
    for lc, rc in zip(cache.layers, ref_cache.layers):
        assert (lc.n_raw, lc.n_comp, lc.n_index_comp) == (
            rc.n_raw, rc.n_comp, rc.n_index_comp)
        assert isinstance(lc.raw, dev.mx.array)
    assert ref_cache.layers[3].n_comp == 1 and ref_cache.layers[2].n_index_comp == 32


def test_transfers_per_call(engine, oracle_gguf):
    """Resident: exactly 1 upload (the ids), 1 download (the last logits) and 1 mx.eval
    per forward call, a 4-token prompt in one; the counter sees the op-by-op MlxBackend's
    hundreds, so it can fail."""
    engine.session(8).sync([1])                     # the RoPE rows go up on first use
    s = engine.session(64)
    with TransferCounter() as c:
        s.sync([1, 5, 9, 11])
    assert (c.up, c.down, c.evals) == (1, 1, 1)
    for t in (3, 4, 5):
        with TransferCounter() as c:
            logits = s.eval(t)
        assert (c.up, c.down, c.evals) == (1, 1, 1)
        assert logits.shape == (engine.cfg.n_vocab,) and np.isfinite(logits).all()
    ops = Engine.open(oracle_gguf, backend="mlx").session(64)
    ops.sync([1])
    with TransferCounter() as c:
        ops.eval(3)
    assert c.up > 100 and c.down > 50


def test_counter_restores_what_it_wraps():
    import mlx.core as mx
    before = (mx.array, mx.eval, np.array, np.asarray, mx.array.item)
    with TransferCounter() as c:
        v = np.asarray(mx.array([1.0, 2.0]))
        mx.array(3.0).item()
    assert (c.up, c.down) == (2, 2)
    assert (mx.array, mx.eval, np.array, np.asarray, mx.array.item) == before
    assert v.tolist() == [1.0, 2.0]


def test_session_snapshot_save_load_rewind(engine, tmp_path):
    s = engine.session(64)
    s.sync([1, 5, 9])
    snap = s.snapshot()
    a = s.eval(7).copy()
    s.restore(snap)
    assert np.array_equal(s.eval(7), a)          # mx arrays are values: exact
    s.save(tmp_path / "s.npz")
    s2 = engine.session(64)
    s2.load(tmp_path / "s.npz")
    assert s2.tokens == [1, 5, 9, 7]
    assert np.array_equal(s2.eval(2), s.eval(2))
    s.rewind(3)
    assert s.tokens == [1, 5, 9]
    s.restore(snap)
    assert np.array_equal(s.logits, snap.logits)


def test_a_trace_and_replayed_decisions_work_on_the_device(engine, oracle_gguf):
    """A trace on a resident session records host copies under the numpy engine's keys;
    forced experts go up as ids and are what the trace then records."""
    host = Engine.open(oracle_gguf, backend="numpy")
    traces = []
    for eng in (engine, host):
        s = eng.session(64)
        s.trace = Trace(names=["exp_ids", "q_rope", "heads"])
        s.sync([1, 5, 9, 11, 13])
        traces.append(s.trace)
    ours, ref = traces
    assert set(ours.keys()) == set(ref.keys()) and len(ref.keys()) > 40
    for k in ref.keys():
        assert isinstance(ours[k], np.ndarray) and ours[k].shape == ref[k].shape, k
    _, ids = ref.series("exp_ids", 3)
    force = {"experts": {3: np.roll(ids, 1, axis=-1)}}
    s = engine.session(64, force_decisions=force)
    s.trace = Trace(names=["exp_ids"])
    s.sync([1, 5, 9, 11, 13])
    assert np.array_equal(s.trace.series("exp_ids", 3)[1], force["experts"][3])


def test_resident_refuses_what_needs_host_arrays(oracle_gguf, tmp_path):
    with pytest.raises(BackendError, match="steering_file needs the op-by-op path"):
        Engine.open(oracle_gguf, backend=MlxBackend(device="cpu"), resident=True,
                    steering_file=tmp_path / "d.f32")
    with pytest.raises(BackendError, match="'numba' computes on host arrays"):
        Engine.open(oracle_gguf, backend="numba", resident=True)


# the modules of chapters 4-8 that hold the model's own code
# (RoPE is glue: numpy's rope_tail on the host, rows of a table on a device)
MODEL_MODULES = ("hc", "norms", "attention", "attention_layer", "compressor", "indexer",
                 "kvcache", "moe", "model", "arrays")


def _model_functions(run):
    """The (module, function) pairs of the model's own code that run executes."""
    seen = set()

    def hook(frame, event, arg):
        if event == "call":
            mod = frame.f_globals.get("__name__", "")
            # a Placed weight is how a device holds a tensor, not the model's math
            placed = (frame.f_code.co_qualname.startswith("Placed.")
                      or isinstance(frame.f_locals.get("self"), Placed))
            if mod.startswith("ds4ref.") and mod[7:] in MODEL_MODULES and not placed:
                seen.add((mod[7:], frame.f_code.co_name))
    sys.setprofile(hook)
    try:
        run()
    finally:
        sys.setprofile(None)
    return seen


def test_the_resident_engine_runs_the_same_model_code_as_numpy(engine, oracle_gguf):
    """Issue 28's criterion: with every array in MLX the engine executes chapter 8's Model,
    Block, Attention and MoE, and the same functions of chapters 4-7 as the numpy
    engine (traced with sys.setprofile); no backend has a forward of its own."""
    host = Engine.open(oracle_gguf, backend="numpy")
    assert isinstance(engine.backend, MlxDevice) and engine.model.be is engine.backend
    prompt = [1, 5, 9, 11, 13, 17, 19, 23]

    def run(eng):
        s = eng.session(64)
        return lambda: (s.sync(prompt), s.eval(3))
    ours, ref = _model_functions(run(engine)), _model_functions(run(host))
    for name in ("__call__", "hidden", "attend", "routed_moe", "select_experts",
                 "shared_ffn", "compressor_decode_one", "indexer_allowed", "push_raw"):
        assert any(f == name for _, f in ref), name
    # the host engine's numpy-only helpers (the reference quantizers) live outside
    # these modules, so the sets agree exactly
    assert ours == ref, (ours ^ ref)


def test_cli_resident_decodes_on_the_device(oracle_gguf, capsys):
    """`python -m ds4ref --backend mlx --resident` prints the greedy text of the resident
    engine (the same arithmetic through the API: equal text is exact, on any machine;
    how close that arithmetic is to ds4.c is the yardstick test's), and a backend
    without a device is refused with a message, exit status 2."""
    from ds4ref.__main__ import main
    args = ["-m", str(oracle_gguf), "-p", "hi", "-n", "3", "--temp", "0", "--no-progress",
            "-c", "64"]
    eng = Engine.open(oracle_gguf, backend=MlxBackend(device="cpu"), resident=True,
                      ctx_size=64)
    s, tok = eng.session(64), eng.tokenizer
    s.sync(tok.chat_prompt("hi", "You are a helpful assistant", "high"))
    out, want = tok.stream_decoder(), ""
    for _ in range(3):
        t = s.argmax()
        want += out(t)
        s.eval(t)
    want += out(None) + "\n"
    assert main(args + ["--backend", "mlx", "--resident"]) == 0
    assert capsys.readouterr().out == want and len(want) > 1
    assert main(args + ["--backend", "numba", "--resident"]) == 2
    assert "computes on host arrays" in capsys.readouterr().err


def test_the_engine_bench_times_the_resident_engine_as_its_own_row(monkeypatch):
    """`--backends mlx-resident` (and cupy-resident on a GPU machine, tools/gpu_check.sh)
    opens the engine with resident=True: the row is labelled so, its sessions hold mx
    arrays, and it decodes."""
    import mlx.core as mx
    from ds4ref.dev.bench_engine import ORACLE_MODEL, bench_backend
    opened, real_session = [], Engine.session

    def spy(self, *a, **k):
        s = real_session(self, *a, **k)
        opened.append(s)
        return s
    monkeypatch.setattr(Engine, "session", spy)
    row = bench_backend(ORACLE_MODEL, "mlx-resident", [0, 5, 9, 17], 2, 64)
    assert row["backend"] == "mlx resident" and row["decode_steps"] == 2
    assert row["prefill_tok_s"] > 0 and row["decode_tok_s"] > 0
    assert opened and all(isinstance(s._cache.layers[0].raw, mx.array) for s in opened)

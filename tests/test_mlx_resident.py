"""Chapter 09's device-resident MLX forward (ds4ref.backends.mlx_resident): op-level
results on ds4.c's ops_A, end-to-end agreement with the numpy reference, and the count
of host<->device transfers per decoded token (MLX on the CPU here)."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("mlx.core")

from _helpers import rel  # noqa: E402

from ds4ref.backends.mlx_backend import MlxBackend  # noqa: E402
from ds4ref.backends.mlx_resident import MlxForward, TransferCounter  # noqa: E402
from ds4ref.engine import Engine  # noqa: E402
from ds4ref.session import SessionError
from ds4ref.kvcache import KVCache  # noqa: E402
from ds4ref.model import forward_token  # noqa: E402
from ds4ref.trace import Trace  # noqa: E402

LAYERS = range(6)


@pytest.fixture(scope="module")
def fw(model):
    cfg, W = model
    return MlxBackend(device="cpu").device_forward(cfg, W, 320)


@pytest.fixture(scope="module")
def engine(oracle_gguf):
    return Engine.open(oracle_gguf, backend=MlxBackend(device="cpu"), resident=True,
                       ctx_size=256)


def _np(x):
    return np.array(x)


def test_weights_stay_quantized(fw, model):
    cfg, W = model
    L = fw.w.layers[0]
    mx = fw.mx
    assert L["attn_q_a"][0].dtype == mx.int8                 # Q8_0 codes, not floats
    assert L["gate_exps"].dtype == mx.uint8                  # raw IQ2_XXS blocks
    assert L["gate_exps"].shape == (cfg.n_expert, cfg.n_ff_exp, cfg.n_embd // 256, 66)
    assert L["down_exps"].shape[-1] == 84                    # raw Q2_K blocks
    assert L["hc_attn_fn"].dtype == mx.float16
    # the upload is the file's tensors (Q8_0 scales as f32: +2 bytes per 34), no more
    file_bytes = sum(t.data.nbytes for lw in W.layers for t in vars(lw).values()
                     if hasattr(t, "data"))
    assert fw.w.nbytes < 1.2 * (file_bytes + W.token_embd.data.nbytes
                                + W.output.data.nbytes + 200_000)


def test_ops_on_ops_A(fw, ops_A, positions, model):
    """Each MlxOps op on ds4.c's recorded inputs: codes exact, floats within 2e-6."""
    cfg, _ = model
    o, mx = fw.ops, fw.mx
    worst = {}

    def note(name, err):
        worst[name] = max(worst.get(name, 0.0), err)

    for p in positions:
        for il in LAYERS:
            K = f"L{il}.P{p}."
            L, ratio = fw.w.layers[il], cfg.compress_ratio(il)
            q, d = o.q8_0(mx.array(ops_A[K + "attn_norm"]))
            assert np.array_equal(_np(q).reshape(-1), ops_A[K + "q8.attn_q_a.qs"])
            note("q8_0 d", rel(_np(d), ops_A[K + "q8.attn_q_a.d"]))
            q, d, bs = o.q8_K(mx.array(ops_A[K + "ffn_norm"]))
            assert np.array_equal(_np(q).reshape(-1),
                                  ops_A[K + "q8k.ffn_gate_up_exps.qs"])
            assert np.array_equal(_np(bs).reshape(-1),
                                  ops_A[K + "q8k.ffn_gate_up_exps.bsums"])
            note("q8_K d", rel(_np(d), ops_A[K + "q8k.ffn_gate_up_exps.d"]))
            qb = o.mv_q8_0(L["attn_q_b"], mx.array(ops_A[K + "qr_norm"]))
            note("Q8_0 matvec", rel(_np(qb), ops_A[K + "q_b"].reshape(-1)))
            x, post, comb = o.hc_pre(mx.array(ops_A[K + "hc_in"]), L["hc_attn_fn"],
                                     L["hc_attn_scale"], L["hc_attn_base"])
            note("hc_pre", max(rel(_np(x), ops_A[K + "attn_x"]),
                               rel(_np(post), ops_A[K + "attn_post"]),
                               rel(_np(comb), ops_A[K + "attn_comb"])))
            kv = o.rope(mx.array(ops_A[K + "kv_normed"]), p, ratio)
            note("rope", rel(_np(kv), ops_A[K + "kv_rope"]))
            note("fp8_kv", rel(_np(o.fp8_kv(mx.array(ops_A[K + "kv_rope"]))),
                               ops_A[K + "kv_fp8"]))
            if K + "idx_q_rope" in ops_A:
                note("indexer_qat", rel(_np(o.indexer_qat(
                    mx.array(ops_A[K + "idx_q_rope"]))), ops_A[K + "idx_q"]))
            X = mx.array(ops_A[K + "after_attn_hc"])
            tok = mx.array(ops_A[f"P{p}.token"].astype(np.int32))
            note("ffn sub-layer", rel(_np(fw._ffn(L, X, tok)), ops_A[K + "hc_out"]))
    print({k: f"{v:.1e}" for k, v in worst.items()})
    for name in ("q8_0 d", "q8_K d", "fp8_kv"):
        assert worst[name] == 0.0, (name, worst[name])
    for name in ("Q8_0 matvec", "hc_pre", "rope", "indexer_qat"):
        assert worst[name] < 2e-6, (name, worst[name])
    # the whole FFN (routing, 6 experts, shared expert, HC post) from ds4.c's input:
    # within 1e-5 unless an int8 code moves (a half-step tie), far below 1e-2 then
    assert worst["ffn sub-layer"] < 1e-2


@pytest.mark.parametrize("path", ["batch", "stream"])
def test_resident_replay_is_as_close_to_ds4c_as_its_rebuilds(path, oracle_dir):
    """ds4.c's "bundled" case (the seed-7 model, a 160-token prompt and 16 greedy steps,
    past the ratio-128 emission at pos 127 and the indexer's top-k selections) through the
    resident forward: every logit measure within the rebuild yardstick (the expert
    measure needs a trace, which needs host arrays), one upload per token fed and one
    download per logit row, and the same cache row counts as chapter 6's cache."""
    from ds4ref.dev.oracle import Rebuilds, distance_to_golden, replay_golden, run_rows
    from ds4ref.dev.writer import synthetic_model_path
    golden = np.load(oracle_dir / "ds4c_bundled.npz")
    eng = Engine.open(synthetic_model_path(), backend=MlxBackend(device="cpu"),
                      resident=True, ctx_size=192)
    with TransferCounter() as c:
        run = replay_golden(eng, golden, path, ctx_size=192)
    rows = run_rows(run, path)
    fed = len(golden["prompt_ids"]) + len(run["step_logits"])      # MLX: token by token
    assert (c.up, c.down) == (fed, len(rows))
    Rebuilds(oracle_dir).check("bundled", path, golden, distance_to_golden(rows, golden, path))


def test_cache_rows_follow_chapter_6s_cache(model, fw):
    """130 tokens (past the ratio-128 emission at pos 127 and the indexer's first
    selections): the device cache holds as many raw, compressed and indexer rows per layer
    as chapter 6's cache after the same tokens."""
    cfg, W = model
    toks = np.random.default_rng(3).integers(0, cfg.n_vocab, 130)
    ref_cache, cache = KVCache(cfg, 320), fw.new_cache()
    for pos, t in enumerate(toks):
        fw.eval(cache, int(t), pos)
        forward_token(cfg, W, ref_cache, int(t), pos)
    host = cache.to_kvcache()
    for lc, rc in zip(host.layers, ref_cache.layers):
        assert (lc.n_raw, lc.n_comp, lc.n_index_comp) == (
            rc.n_raw, rc.n_comp, rc.n_index_comp)
    assert ref_cache.layers[3].n_comp == 1 and ref_cache.layers[2].n_index_comp == 32


def test_transfers_per_token(engine, oracle_gguf):
    """Resident decode: exactly 1 upload (the token id), 1 download (the logits) and 1
    mx.eval per token; a prompt sync downloads only its last logits. The counter sees
    the op-by-op MlxBackend's hundreds, so it can fail."""
    s = engine.session(64)
    with TransferCounter() as c:
        s.sync([1, 5, 9, 11])
    assert (c.up, c.down, c.evals) == (4, 1, 4)
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


def test_resident_refuses_what_it_does_not_do(engine):
    s = engine.session(64)
    s.trace = Trace()
    with pytest.raises(SessionError, match="resident=False"):
        s.sync([1, 2])
    with pytest.raises(SessionError, match="ctx_size"):
        engine.session(4096)


def test_cli_resident_decodes_on_the_device(oracle_gguf, capsys):
    """`python -m ds4ref --backend mlx --resident` prints the greedy text of the resident
    engine (the same arithmetic through the API: equal text is exact, on any machine;
    how close that arithmetic is to ds4.c is the yardstick test's), and a backend
    without a device forward is refused with a message, exit status 2."""
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
    assert "no device forward" in capsys.readouterr().err


def test_the_engine_bench_times_the_resident_forward_as_its_own_row(monkeypatch):
    """`--backends mlx-resident` (and cupy-resident on a GPU machine, tools/gpu_check.sh) opens the engine
    with resident=True: the row is labelled so, its session is a ResidentSession, and it decodes."""
    from ds4ref.dev.bench_engine import ORACLE_MODEL, bench_backend
    from ds4ref.resident import ResidentSession
    opened, real_session = [], Engine.session

    def spy(self, *a, **k):
        s = real_session(self, *a, **k)
        opened.append(type(s))
        return s
    monkeypatch.setattr(Engine, "session", spy)
    row = bench_backend(ORACLE_MODEL, "mlx-resident", [0, 5, 9, 17], 2, 64)
    assert row["backend"] == "mlx resident" and row["decode_steps"] == 2
    assert row["prefill_tok_s"] > 0 and row["decode_tok_s"] > 0
    assert opened and all(t is ResidentSession for t in opened)

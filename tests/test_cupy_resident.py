"""Chapter 09's CuPy backend on device arrays (CupyDevice: chapter 8's Model with every
array on the GPU) through the stand-in `cupy` of ds4ref.dev.cupy_standin (numpy behind a
counting device boundary, the kernels' launches running chapter 3/5's numpy references):
the transfers per decoded token, the logits against the numpy engine, and named errors.
The same checks on real CuPy are marked `gpu` (tools/gpu_check.sh runs them on a lent
GPU machine)."""
from __future__ import annotations

import numpy as np
import pytest

from ds4ref.backend import BackendError, Placed
from ds4ref.backends.cupy_backend import CupyBackend, CupyDevice
from ds4ref.dev.cupy_standin import DeviceArray, StandinCupy, StandinError
from ds4ref.dev.writer import synthetic_model_path
from ds4ref.engine import Engine
from ds4ref.kvcache import KVCache
from ds4ref.model import Model, ModelError
from ds4ref.session import ContextOverflowError, TokenRangeError
from ds4ref.trace import Trace

CTX = 192


@pytest.fixture(scope="module")
def path():
    return synthetic_model_path()


@pytest.fixture(scope="module")
def engine(path):
    return Engine.open(path, backend=CupyBackend(cp=StandinCupy()), resident=True,
                       ctx_size=CTX)


@pytest.fixture(scope="module")
def reference(path):
    return Engine.open(path, backend="numpy")


def _delta(cp, fn):
    before = cp.counts()
    out = fn()
    return out, tuple(b - a for a, b in zip(before, cp.counts()))


def _host(engine, s):
    return s._cache.map(engine.backend.download)


def test_weights_stay_quantized_and_go_up_once(engine):
    """Every weight a kernel reads is placed once as its raw GGUF rows (uint8 on the
    device, the 3-D experts as [n_expert * rows, row_bytes]); the device holds the file's
    quantized bytes and no dequantized copy; placing a tensor again is free."""
    be, cfg, W = engine.backend, engine.cfg, engine.weights
    assert isinstance(be, CupyDevice) and be.xp is be.cp
    w = engine.model.blocks[0].attn.w
    assert isinstance(w.attn_q_a, Placed) and w.attn_q_a.data.dtype == np.uint8
    assert w.attn_q_a.data.shape == W.layers[0].attn_q_a.data.shape
    experts = engine.model.blocks[0].ffn.w.ffn_gate_exps.data
    assert experts.shape == (cfg.n_expert * cfg.n_ff_exp, cfg.n_embd // 256 * 66)
    assert isinstance(w.attn_norm, DeviceArray) and w.attn_norm.dtype == np.float32
    quantized = [t for t in W.tensors() if t is not None and t.ggml_type not in (0, 26)
                 and (len(t.shape) == 3 or t.name in ("token_embd.weight",)
                      or t.ggml_type != 0)]
    raw = sum(t.data.nbytes for t in quantized)
    assert raw - 200_000 < be.resident_bytes() <= raw
    up = be.cp.uploads
    assert be.place(W.layers[0].attn_q_a) is w.attn_q_a and be.cp.uploads == up


def test_transfers_per_token_are_the_ids_up_and_the_logits_down(engine, path):
    """One upload (the ids) and one download (the last logits) per call: a 4-token prompt
    in one batched call (Q8_0 by the 8-token kernel, the experts of all (token, slot)
    pairs in one launch per pass), then each decoded token. A decoded token launches
    exactly the kernels the op-by-op CupyBackend launches for it, which crosses the bus
    hundreds of times around them."""
    cp = engine.backend.cp
    engine.session(8).sync([1])         # the RoPE rows go up on first use, once
    s = engine.session(64)
    held, bytes_up, launched = engine.backend.resident_bytes(), cp.upload_bytes, dict(
        cp.launched)
    _, d = _delta(cp, lambda: s.sync([1, 5, 9, 11]))
    assert d[:2] == (1, 1) and cp.upload_bytes - bytes_up == 16
    assert engine.backend.resident_bytes() == held
    grew = {k: v - launched.get(k, 0) for k, v in cp.launched.items()}
    n_layer = engine.cfg.n_layer
    assert grew["matmul_q8_0_q8_0"] >= 5 * n_layer
    assert grew["matvec_q8_0_q8_0"] == 1                 # the output head, last token
    assert grew["matvec_iq2_xxs_pair_q8_K"] == grew["matvec_q2_K_q8_K"] == n_layer
    ops_cp = StandinCupy()
    ops = Engine.open(path, backend=CupyBackend(cp=ops_cp).strict()).session(64)
    ops.sync([1, 5, 9, 11])
    for t in (3, 4, 5, 6, 7):
        logits, d = _delta(cp, lambda: s.eval(t))
        _, d_ops = _delta(ops_cp, lambda: ops.eval(t))
        assert d[:2] == (1, 1), d
        assert d[2] == d_ops[2], (d, d_ops)
        assert d_ops[0] > 200 and d_ops[1] > 100
        assert logits.shape == (engine.cfg.n_vocab,) and np.isfinite(logits).all()


def test_logits_equal_the_numpy_engine_bit_for_bit(engine, reference):
    """Greedy decoding, 130 tokens (past the indexer's first top-k selection, where a
    ratio-4 layer holds more than 16 rows, and the ratio-128 row at position 127): with
    the stand-in the device model runs numpy's operations in the reference's order,
    so the logits are equal bit for bit (tolerance 0), and so are the cache's rows."""
    cfg = engine.cfg
    s, r = engine.session(CTX), reference.session(CTX)
    tok = 1
    for _ in range(130):
        ours, ref = s.eval(tok), r.eval(tok)
        assert np.array_equal(ours, ref), (s.pos, np.abs(ours - ref).max())
        tok = int(ref.argmax())
    host = _host(engine, s)
    for lc, rc in zip(host.layers, r._cache.layers):
        assert (lc.n_raw, lc.n_comp, lc.n_index_comp) == (rc.n_raw, rc.n_comp,
                                                          rc.n_index_comp)
        assert np.array_equal(lc.raw, rc.raw)
        assert lc.comp is None or np.array_equal(lc.comp, rc.comp)
    ratios = [cfg.compress_ratio(il) for il in range(cfg.n_layer)]
    assert host.layers[ratios.index(128)].n_comp == 1
    assert host.layers[ratios.index(4)].n_index_comp > cfg.indexer_top_k


@pytest.mark.parametrize("n", [4, 38, 139])
def test_the_device_prefill_equals_the_numpy_prefill_bit_for_bit(engine, reference, n):
    """A prompt's batched prefill on the device (layer-major, matmul, experts by (token,
    slot) pairs): with the stand-in's numpy twins the last logits, the cache rows and
    states and the next steps equal the numpy engine's prefill bit for bit; 139 tokens
    pass the 128-row window and the ratio-128 row."""
    prompt = [(7 * i + 3) % engine.cfg.n_vocab for i in range(n)]
    s, r = engine.session(CTX), reference.session(CTX)
    s.sync(prompt), r.sync(prompt)
    assert np.array_equal(s.logits, r.logits)
    for lc, rc in zip(_host(engine, s).layers, r._cache.layers):
        for name, v in vars(rc).items():
            if isinstance(v, np.ndarray):
                assert np.array_equal(getattr(lc, name), v), name
    for t in (5, 6, 7):
        assert np.array_equal(s.eval(t), r.eval(t))


def test_a_trace_on_the_device_records_what_numpy_records(engine, reference):
    """A trace and replayed decisions work on device arrays: the trace downloads what it
    records (equal to numpy's, bit for bit, through the stand-in), and forced experts
    go up as ids."""
    names = ["exp_ids", "q_rope", "comp_allowed", "heads", "logits"]
    runs = []
    for eng in (engine, reference):
        s = eng.session(64)
        s.trace = Trace(names=names)
        s.sync([1, 5, 9, 11, 13, 17])
        runs.append(s.trace)
    ours, ref = runs
    assert set(ours.keys()) == set(ref.keys()) and len(ref.keys()) > 40
    for k in ref.keys():
        assert np.array_equal(ours[k], ref[k]), k
    _, ids = ref.series("exp_ids", 3)
    force = {"experts": {3: np.roll(ids, 1, axis=-1)}}
    s = engine.session(64, force_decisions=force)
    s.trace = Trace(names=["exp_ids"])
    s.sync([1, 5, 9, 11, 13, 17])
    assert np.array_equal(s.trace.series("exp_ids", 3)[1], force["experts"][3])


def test_bad_input_raises_named_errors_and_the_session_stays_usable(engine):
    cfg = engine.cfg
    s = engine.session(8)
    for bad in (cfg.n_vocab, -1):
        with pytest.raises(TokenRangeError):
            s.eval(bad)
    with pytest.raises(TokenRangeError):
        s.sync([1, cfg.n_vocab])
    s.sync([1, 2, 3, 4, 5, 6, 7])
    with pytest.raises(ContextOverflowError):
        s.eval(8)                                  # a session of 8 holds at most 7 tokens
    with pytest.raises(ContextOverflowError):
        s.sync(list(range(8)))
    for bad in ([], [[1, 2]], [1, cfg.n_vocab], [-1, 2]):
        with pytest.raises(ModelError):
            engine.model(np.array(bad), KVCache(cfg, 8, engine.backend.xp))
    assert s.tokens == [1, 2, 3, 4, 5, 6, 7] and np.isfinite(s.logits).all()


def test_positions_past_the_cache_are_refused_before_any_row_is_written(engine):
    """The device cache's rows never overflow: a call whose positions pass its ctx_size is refused where the
    tokens arrive (chapter 8's check_tokens), before a row is written on the device."""
    cache = KVCache(engine.cfg, 8, engine.backend.xp)
    engine.model([1, 2, 3, 4, 5, 6], cache)
    before = [(c.n_raw, c.n_comp, c.n_index_comp) for c in cache.layers]
    with pytest.raises(ModelError, match="do not fit a cache of ctx_size 8"):
        engine.model([1, 2, 3], cache, 6)
    assert [(c.n_raw, c.n_comp, c.n_index_comp) for c in cache.layers] == before


def test_snapshot_restore_save_load(engine, tmp_path):
    s = engine.session(64)
    s.sync([1, 5, 9])
    snap = s.snapshot()
    a = s.eval(7).copy()
    s.restore(snap)
    assert np.array_equal(s.eval(7), a)
    s.save(tmp_path / "s.npz")
    s2 = engine.session(64)
    s2.load(tmp_path / "s.npz")
    assert s2.tokens == [1, 5, 9, 7]
    assert isinstance(s2._cache.layers[0].raw, DeviceArray)
    assert np.array_equal(s2.eval(2), s.eval(2))


def test_the_standin_refuses_what_cupy_refuses():
    cp = StandinCupy()
    a = cp.asarray(np.ones(4, np.float32))
    with pytest.raises(StandinError, match="host numpy array"):
        a + np.ones(4, np.float32)                 # CuPy: TypeError, no implicit upload
    with pytest.raises(StandinError, match="Implicit conversion"):
        np.asarray(a)                              # CuPy: TypeError, no implicit download
    assert cp.counts() == (1, 0, 0)
    assert float(a.sum()) == 4.0 and cp.counts() == (1, 1, 0)   # a scalar read is a download
    k = CupyBackend(cp=cp).k["matvec_f16_f32"]
    y = cp.empty((4,), cp.float32)
    with pytest.raises(StandinError, match="int rows"):
        k((1, 1), (128,), (cp.zeros((4, 8), cp.uint8), 4, np.int32(4), a, y))
    with pytest.raises(StandinError, match="C-contiguous"):
        k((1, 1), (128,), (cp.zeros((8, 4), cp.uint8).T, np.int32(4), np.int32(4), a, y))
    with pytest.raises(StandinError, match="covers fewer"):
        k((1, 1), (32,), (cp.zeros((4, 8), cp.uint8), np.int32(4), np.int32(4), a, y))


# ---------------------------------------------------------------------------------------
# The same on real CuPy (skipped without a CUDA GPU; run by tools/gpu_check.sh)

class CountingCupy:
    """The real cupy module, with uploads (asarray / array of host data) and downloads
    (asnumpy) counted at the module's names; reads through array methods (.get(),
    int()) are not seen here (the stand-in tests above count those)."""

    def __init__(self, cp):
        self._cp, self.up, self.down = cp, 0, 0

    def __getattr__(self, name):
        return getattr(self._cp, name)

    def asarray(self, a, *args, **kw):
        self.up += not isinstance(a, self._cp.ndarray)
        return self._cp.asarray(a, *args, **kw)

    def array(self, a, *args, **kw):
        self.up += not isinstance(a, self._cp.ndarray)
        return self._cp.array(a, *args, **kw)

    def asnumpy(self, a, *args, **kw):
        self.down += 1
        return self._cp.asnumpy(a, *args, **kw)


class SourceCounts:
    """The stand-in's counters under CountingCupy's names (up, down)."""

    def __init__(self, cp):
        self.cp = cp

    up = property(lambda self: self.cp.uploads)
    down = property(lambda self: self.cp.downloads)


@pytest.mark.parametrize("where,path", [("cuda-on-cpu", "stream"),
                                        pytest.param("gpu", "stream", marks=pytest.mark.gpu),
                                        pytest.param("gpu", "batch", marks=pytest.mark.gpu)])
def test_resident_kernels_replay_ds4c_as_closely_as_its_rebuilds(where, path, oracle_dir):
    """The kernels' own source (compiled for the CPU, appendix F) or a CUDA GPU replaying
    ds4.c's "bundled" case (the seed-7 model, a 160-token prompt and 16 greedy steps, past
    the ratio-128 emission at pos 127 and the indexer's top-k selections): one upload per
    forward call (the stream path: every token; the batch path: the prompt's ids in one
    upload) and one download per logit row, and every logit measure within the rebuild
    yardstick, the criterion of every free run against ds4.c. On the CPU only the stream
    path runs: the kernels' source is slow there, and the batched device prefill equals
    numpy's bit for bit through the stand-in (above)."""
    from ds4ref.dev.oracle import Rebuilds, distance_to_golden, replay_golden, run_rows
    if where == "gpu":
        import cupy
        cp = counts = CountingCupy(cupy)
    else:
        from ds4ref.dev.cuda_on_cpu import source_standin
        cp = source_standin()
        counts = SourceCounts(cp)
    golden = np.load(oracle_dir / "ds4c_bundled.npz")
    eng = Engine.open(synthetic_model_path(), backend=CupyBackend(cp=cp), resident=True,
                      ctx_size=CTX)
    eng.session(8).sync([1])                    # the RoPE rows go up on first use
    up, down = counts.up, counts.down
    run = replay_golden(eng, golden, path, ctx_size=CTX)
    rows = run_rows(run, path)
    calls = len(rows) if path == "stream" else 1 + len(run["step_logits"])
    assert (counts.up - up, counts.down - down) == (calls, len(rows))
    Rebuilds(oracle_dir).check("bundled", path, golden,
                               distance_to_golden(rows, golden, path))
    s = eng.session(CTX)
    s.sync([1])
    with pytest.raises(TokenRangeError):
        s.eval(eng.cfg.n_vocab)


def test_resident_engine_runs_the_one_model(engine, path):
    """Engine.open(resident=True) gives the backend's device version (be.on_device()) and
    chapter 8's Model and Session over its arrays; numpy has no device, and what needs
    host arrays between ops is refused at open, by name."""
    assert isinstance(engine.model, Model) and engine.resident
    assert isinstance(engine.session()._cache.layers[0].raw, DeviceArray)
    with pytest.raises(BackendError, match="'numpy' computes on host arrays"):
        Engine.open(path, backend="numpy", resident=True)
    with pytest.raises(BackendError, match="steering_file needs the op-by-op path"):
        Engine.open(path, backend=CupyBackend(cp=StandinCupy()), resident=True,
                    steering_file=path)

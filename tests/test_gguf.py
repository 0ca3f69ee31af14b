"""Chapter 01: the GGUF reader, ModelConfig, the weight binding, the writer, and bad input.

The reader is checked against gguf-py's GGUFReader (an independent implementation) on the
oracle GGUF that ds4.c ran; the writer's output is read back by both readers.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import struct
import subprocess
import sys
import time

import gguf
import numpy as np
import pytest
from gguf import GGUFReader
from gguf.quants import dequantize
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ds4ref
from ds4ref.config import ModelConfig, config_from_metadata, layer_compress_ratio
from ds4ref.gguf import GGMLType, GGUFError, GGUFFile, GGUFValueType as V, type_nbytes
from ds4ref.weights import bind_weights, check_tokenizer_metadata, load_model, tensor_specs
from ds4ref.dev.writer import (
    TensorData,
    synthetic_model_path,
    model_metadata,
    model_tensors,
    write_gguf,
    write_model,
)
from ds4ref.dev.bpe import train_bpe, CORPUS
from ds4ref.bundled import default_model_path

DEFAULT_MODEL_SHA256 = "b83839d07adb619596e1f57cdbb9925eddad4eb2d8bf2e92ad67c4535dffa36d"

# A micro DS4 shape: 3 layers (dense, dense, ratio 4 with indexer), every tensor kind, ~0.4 MB.
MICRO = dataclasses.replace(
    ModelConfig.tiny(), n_layer=3, n_vocab=300, n_head=2, head_dim=192, value_dim=192, n_lora_q=32,
    n_lora_o=32, n_out_group=1, n_expert=4, n_expert_used=2, n_hash_layer=1, n_indexer_head=2,
    indexer_top_k=4, compress_ratios=(0, 0, 4))


# ---------------------------------------------------------------- the oracle vs gguf-py

@pytest.fixture(scope="module")
def oracle(oracle_gguf):
    g = GGUFFile(oracle_gguf)
    yield g, GGUFReader(oracle_gguf)
    g.close()


def test_every_metadata_key_value_and_type_matches_gguf_py(oracle):
    g, r = oracle
    fields = {k: f for k, f in r.fields.items() if not k.startswith("GGUF.")}
    assert list(g.metadata) == list(fields)
    for key, f in fields.items():
        assert g.metadata[key] == f.contents(), key
        assert tuple(int(t) for t in g.metadata_types[key]) == tuple(int(t) for t in f.types), key
    assert g.version == 3 and g.alignment == 32 == r.alignment


def test_every_tensor_type_shape_and_byte_range_matches_gguf_py(oracle):
    g, r = oracle
    assert g.data_offset == r.data_offset
    assert list(g.tensors) == [t.name for t in r.tensors]
    for t in r.tensors:
        mine = g.tensors[t.name]
        assert mine.ggml_type == int(t.tensor_type), t.name
        assert mine.shape == tuple(int(d) for d in t.shape), t.name
        assert (mine.offset, mine.nbytes) == (t.data_offset, t.n_bytes), t.name
        assert np.array_equal(mine.data, np.asarray(t.data).reshape(-1).view(np.uint8)), t.name


def test_tensor_data_is_a_zero_copy_view_of_the_mapping(oracle):
    g, _ = oracle
    base = np.frombuffer(g._mm, np.uint8, 1, 0).ctypes.data        # address of the mapping's first byte
    for name in ("token_embd.weight", "blk.3.ffn_gate_exps.weight", "output.weight"):
        t = g.tensors[name]
        assert not t.data.flags.owndata and not t.data.flags.writeable, name
        assert t.data.ctypes.data - base == t.offset, name          # the view's memory is the file's bytes


def test_block_table_matches_gguf_py():
    from gguf.constants import GGML_QUANT_SIZES
    from ds4ref.ggml_types import GGML_BLOCK
    for t, size in GGML_BLOCK.items():
        assert GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(t))] == size, t.name


def test_oracle_loads_with_the_readme_shape(oracle_gguf):
    g, cfg, w = load_model(oracle_gguf)
    with g:
        assert cfg == ModelConfig.tiny()
        assert (cfg.n_layer, cfg.n_embd, cfg.n_vocab, cfg.n_head, cfg.head_dim, cfg.n_expert) == (6, 256, 1024, 8, 256, 16)
        assert cfg.compress_ratios == (0, 0, 4, 128, 4, 128)
        assert len(g.tensors) == 178 == len(w.tensors())
        assert [l.il for l in w.layers if l.indexer_proj is not None] == [2, 4]
        assert [l.il for l in w.layers if l.attn_compressor_kv is not None] == [2, 3, 4, 5]
        assert [l.il for l in w.layers if l.ffn_gate_tid2eid is not None] == [0, 1, 2]
        assert [l.il for l in w.layers if l.ffn_exp_probs_b is not None] == [3, 4, 5]
        assert w.layers[2].attn_compressor_ape.shape == (512, 4) and w.layers[3].attn_compressor_ape.shape == (256, 128)
        assert w.layers[0].ffn_gate_exps.ggml_type == GGMLType.IQ2_XXS
        assert w.layers[0].ffn_down_exps.ggml_type == GGMLType.Q2_K


def test_tensor_numpy_and_expert_views_match_gguf_py(oracle):
    g, r = oracle
    w = bind_weights(g, ModelConfig.from_gguf(g))
    ref = {t.name: t for t in r.tensors}
    for t in (w.token_embd, w.output_norm, w.layers[1].ffn_gate_tid2eid, w.layers[0].hc_attn_fn):
        want = np.asarray(ref[t.name].data)
        assert t.numpy().shape == want.shape and np.array_equal(t.numpy(), want.astype(t.numpy().dtype)), t.name
    tid = w.layers[0].ffn_gate_tid2eid
    # ds4 reads entry (token, i) at flat index 6*token + i (ds4-map §5 row 12)
    assert tid.numpy()[5, 3] == tid.data.reshape(-1).view("<i4")[6 * 5 + 3]
    down = w.layers[4].ffn_down_exps
    for e in (0, 7, 15):
        x = down.expert(e)
        assert x.shape == (256, 256) and x.data.shape == (256, down.row_bytes)
        assert np.array_equal(x.data, np.asarray(ref[down.name].data)[e])
    with pytest.raises(GGUFError, match="expert 16 is outside"):
        down.expert(16)
    with pytest.raises(GGUFError, match="quantized"):
        w.output.numpy()


def test_expert_tensor_values_decode_like_gguf_py(oracle):
    """Row bytes of a routed expert dequantize (gguf-py) to the same values as the whole tensor's slice."""
    g, r = oracle
    w = bind_weights(g, ModelConfig.from_gguf(g))
    t = w.layers[3].ffn_gate_exps
    whole = dequantize(np.asarray([x for x in r.tensors if x.name == t.name][0].data), gguf.GGMLQuantizationType.IQ2_XXS)
    one = dequantize(t.expert(5).data, gguf.GGMLQuantizationType.IQ2_XXS)
    assert np.array_equal(one, whole[5])


# ---------------------------------------------------------------- config

def test_real_and_tiny_configs_round_trip_through_metadata():
    for cfg in (ModelConfig.real(), ModelConfig.tiny(), ModelConfig.wide(), MICRO):
        md = cfg.to_metadata()
        back = config_from_metadata({k: v for k, _, v in md}, {k: t for k, t, _ in md})
        assert back == cfg
        assert back.rms_eps == 1e-6 and back.rope_freq_base == 10000.0    # the constants, not float32(1e-6)


def test_real_config_is_ds4c_enum():
    c = ModelConfig.real()
    assert (c.n_layer, c.n_embd, c.n_vocab, c.q_dim, c.out_low_dim, c.hc_dim, c.hc_mix) == (43, 4096, 129280, 32768, 8192, 16384, 24)
    assert c.compress_ratios[:6] == (0, 0, 4, 128, 4, 128) and c.compress_ratios.count(4) == 21
    assert c.compress_ratios.count(128) == 20


@pytest.mark.parametrize("change, message", [
    (dict(n_head_kv=2), "head_count_kv': ds4 has one shared KV head"),
    (dict(value_dim=128), "value_length must equal key_length"),
    (dict(indexer_head_dim=64), "Hadamard-128"),
    (dict(n_out_group=3), "3 groups do not divide 8 heads"),
    (dict(n_embd=300), "embedding_length': 300 is not a multiple of 256"),
    (dict(compress_ratios=(0, 0, 4, 4, 4, 128)), "layer 3 has ratio 4, ds4 requires 128"),
    (dict(compress_ratios=(0, 0, 4)), "3 ratios for 6 layers"),
    (dict(rms_eps=1e-5), "layer_norm_rms_epsilon': expected 9.99999997e-07, got 9.99999975e-06"),
    (dict(head_dim=128, value_dim=128), "key_length': must differ from the indexer key length"),
    (dict(n_ff_exp=300), "expert_feed_forward_length': 300 is not a multiple of 256 (quant"),
    (dict(rope_freq_base=10001.0), "rope.freq_base': expected 10000, got 10001"),
    (dict(swiglu_clamp=7.0), "swiglu_clamp_exp': expected 10, got 7"),
    (dict(n_expert_used=17), "17 used experts out of 16"),
    (dict(hc_sinkhorn_iter=2**31), "sinkhorn_iterations': expected 20 as ds4.c, got 2147483648"),
    (dict(n_hc=3), "hyper_connection.count': expected 4 as ds4.c, got 3"),
    (dict(n_rot=128), "rope.dimension_count': expected 64 as ds4.c, got 128"),
    (dict(n_swa=4096), "attention.sliding_window': 4096 is more than ds4.c's 128"),
    (dict(indexer_top_k=513), "attention.indexer.top_k': 513 is more than ds4.c's 512"),
    (dict(n_layer=44, compress_ratios=tuple(layer_compress_ratio(i) for i in range(44))),
     "block_count': 44 is more than ds4.c's 43"),
    (dict(n_vocab=2**32 - 1), "vocab_size': 4294967295 is more than ds4.c's 129280"),
])
def test_inconsistent_config_is_refused_naming_the_key(change, message):
    with pytest.raises(GGUFError, match=message.replace("(", r"\(")):
        dataclasses.replace(ModelConfig.tiny(), **change)


def test_float_tolerance_is_ds4c_config_expect_f32():
    ok = dataclasses.replace(ModelConfig.tiny(), rope_freq_base=10000.0 + 0.009)   # 9e-7 relative
    assert ok.rope_freq_base == 10000.0                                          # stored as ds4's constant
    with pytest.raises(GGUFError):
        dataclasses.replace(ModelConfig.tiny(), rms_eps=1e-6 + 2e-6)              # |Δ| > 1e-6 * 1


# ---------------------------------------------------------------- writer

@pytest.fixture(scope="module")
def micro_path(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("micro") / "micro.gguf", MICRO, seed=3)


def test_writer_round_trip_loads_identically(micro_path):
    g, cfg, w = load_model(micro_path)
    with g:
        assert cfg == config_from_metadata({k: v for k, _, v in MICRO.to_metadata()})
        want = {k: v for k, _, v in model_metadata(MICRO, seed=3)}
        assert {k: v for k, v in g.metadata.items()} == {k: (float(np.float32(v)) if isinstance(v, float) else v)
                                                         for k, v in want.items()}
        specs = [s for s in tensor_specs(MICRO) if not (s.optional and s.il < MICRO.n_hash_layer)]
        assert list(g.tensors) == [s.name for s in specs]
        # gguf-py reads the same directory and bytes
        r = GGUFReader(micro_path)
        for t in r.tensors:
            mine = g.tensors[t.name]
            assert (mine.ggml_type, mine.shape, mine.offset, mine.nbytes) == (
                int(t.tensor_type), tuple(int(d) for d in t.shape), t.data_offset, t.n_bytes)
            assert np.array_equal(mine.data, np.asarray(t.data).reshape(-1).view(np.uint8))
        assert {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")} == g.metadata


def test_writer_is_deterministic_and_seeded(tmp_path):
    a = write_model(tmp_path / "a.gguf", MICRO, seed=3)
    b = write_model(tmp_path / "b.gguf", MICRO, seed=3)
    c = write_model(tmp_path / "c.gguf", MICRO, seed=4)
    h = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()
    assert h(a) == h(b) != h(c)


def test_written_weights_give_unit_rms_matvecs(micro_path):
    """Every projection's output RMS on a unit-RMS input stays near 1 (gguf-py dequantizes)."""
    rng = np.random.default_rng(0)
    with GGUFFile(micro_path) as g:
        r = GGUFReader(micro_path)
        for t in r.tensors:
            spec_type = GGMLType(int(t.tensor_type))
            if spec_type not in (GGMLType.Q8_0, GGMLType.IQ2_XXS, GGMLType.Q2_K) or t.name == "output.weight":
                continue
            w = dequantize(np.asarray(t.data), t.tensor_type).astype(np.float64)
            w = w.reshape(-1, w.shape[-1])                      # [rows, in]
            y = w @ rng.standard_normal(w.shape[-1])
            assert 0.75 < np.sqrt(np.mean(y ** 2)) < 1.3, t.name
        out = dequantize(np.asarray(g.tensors["output.weight"].data.reshape(300, -1)), gguf.GGMLQuantizationType.Q8_0)
        assert 2.0 < np.std(out @ rng.standard_normal(256)) < 3.0


def test_q2_k_blocks_are_valid_and_zero_centred(micro_path):
    with GGUFFile(micro_path) as g:
        t = g.tensors["blk.0.ffn_down_exps.weight"]
        blocks = t.data.reshape(-1, 84)
        sc, m = blocks[:, :16] & 15, blocks[:, :16] >> 4
        assert sc.min() >= 1 and sc.max() <= 10 and np.all(m == np.rint(1.5 * sc))
        d = blocks[:, 80:82].copy().view("<f2").astype(np.float32)
        assert np.all(np.isfinite(d)) and np.all(d > 0)
        w = dequantize(t.data.reshape(-1, 84), gguf.GGMLQuantizationType.Q2_K)
        assert abs(w.mean()) < 0.05 * w.std()


def test_q4_k_experts_are_valid_zero_centred_and_calibrated(tmp_path):
    p = write_model(tmp_path / "q4k.gguf", MICRO, seed=5, expert_types=("Q4_K", "Q4_K"))
    g, cfg, w = load_model(p)
    with g:
        t = w.layers[2].ffn_down_exps
        assert t.ggml_type == GGMLType.Q4_K and w.layers[2].ffn_gate_exps.ggml_type == GGMLType.Q4_K
        v = dequantize(t.expert(1).data, gguf.GGMLQuantizationType.Q4_K).astype(np.float64)   # [out, in]
        assert abs(v.mean()) < 0.05 * v.std()
        y = v @ np.random.default_rng(1).standard_normal(v.shape[1])
        assert 0.75 < np.sqrt(np.mean(y ** 2)) < 1.3


def test_tokenizer_has_ds4_special_tokens_and_real_merges(micro_path, oracle_gguf):
    with GGUFFile(micro_path) as g:
        check_tokenizer_metadata(g)
        toks = g.metadata["tokenizer.ggml.tokens"]
        assert len(toks) == MICRO.n_vocab and toks[0] == "<｜begin▁of▁sentence｜>" and toks[1] == "<｜end▁of▁sentence｜>"
        assert toks[2 + ord("a")] == "a" and toks[2 + 32] == "Ġ" and toks[2 + 10] == "Ċ"
        merges = g.metadata["tokenizer.ggml.merges"]
        vocab = set(toks)
        for m in merges:
            a, b = m.split(" ")
            assert a in vocab and b in vocab and a + b in vocab, m
    # the byte alphabet is the same one the oracle's vocabulary uses
    with GGUFFile(oracle_gguf) as o:
        assert o.metadata["tokenizer.ggml.tokens"][2:258] == toks[2:258]
    assert len(train_bpe(CORPUS, 2000)) > 600


def test_appendix_c_quotes_the_bpe_corpus_it_trains_on():
    """Appendix C shows CORPUS as a quoted paragraph in markdown; the folded code holds
    the string. Word for word they are the same text (line breaks aside)."""
    from pathlib import Path

    nb = json.loads((Path(__file__).resolve().parents[1] / "book" / "C_testmodels.ipynb")
                    .read_text())
    quoted = [
        "".join(c["source"]) for c in nb["cells"]
        if c["cell_type"] == "markdown" and "`CORPUS`" in "".join(c["source"])
    ]
    assert len(quoted) == 1
    text = " ".join(line[1:] for line in quoted[0].splitlines() if line.startswith(">"))
    assert text.split() == CORPUS.split()


def test_synthetic_model_is_generated_once_and_validates(tmp_path, monkeypatch):
    monkeypatch.setenv("DS4REF_CACHE", str(tmp_path / "cache"))
    p = synthetic_model_path()
    first = p.stat().st_mtime_ns
    assert synthetic_model_path() == p and p.stat().st_mtime_ns == first
    g, cfg, w = load_model(p)
    with g:
        assert cfg == ModelConfig.tiny() and len(w.tensors()) == 178
    s = ds4ref.model_summary(p)
    assert "6 layers, n_embd 256, vocab 1024" in s and "178 tensors" in s and "IQ2_XXS" in s
    # Later chapters store outputs computed on this model: its bytes must not change silently.
    # If the writer changes on purpose, bump writer.WRITER_VERSION and this hash together.
    assert hashlib.sha256(p.read_bytes()).hexdigest() == DEFAULT_MODEL_SHA256, "bump WRITER_VERSION"


def test_model_summary_of_oracle(oracle_gguf):
    s = ds4ref.model_summary(oracle_gguf)
    assert "ds4-tiny-synthetic-seed1" in s and "compress ratios 0 x2, (4, 128) x2; indexer" in s
    assert re.search(r"Q8_0 +49 tensors +4.14 MB", s) and re.search(r"F32 +66 tensors", s)


def test_writer_streams_expert_tensors_one_expert_at_a_time():
    wide = ModelConfig.wide()
    ts = {t.name: t for t in model_tensors(wide)}
    down = ts["blk.0.ffn_down_exps.weight"]
    assert down.nbytes == 2048 * 4096 * 256 // 256 * 84          # 704 MB in all...
    first = next(iter(down.chunks()))
    assert first.nbytes == down.nbytes // 256                    # ...2.75 MB per chunk


# ---------------------------------------------------------------- bad input

def _small_gguf(tmp_path, alignment=32, extra_meta=(), tensors=None, name="small.gguf"):
    """A small generic GGUF: a few keys of each kind and three tensors."""
    meta = [("general.alignment", (V.UINT32,), alignment), ("a.u8", (V.UINT8,), 7), ("a.str", (V.STRING,), "héllo"),
            ("a.f64", (V.FLOAT64,), 0.5), ("a.bool", (V.BOOL,), True),
            ("a.arr", (V.ARRAY, V.INT16), [1, -2, 3]), ("a.nested", (V.ARRAY, V.ARRAY, V.STRING), [["x"], [], ["y", "z"]]),
            *extra_meta]
    if tensors is None:
        tensors = [TensorData("t.f32", GGMLType.F32, (5,), lambda: [np.arange(5, dtype="<f4")]),
                   TensorData("t.q8", GGMLType.Q8_0, (32, 2), lambda: [np.full(68, 1, np.uint8)]),
                   TensorData("t.i32", GGMLType.I32, (3, 2), lambda: [np.arange(6, dtype="<i4")])]
    return write_gguf(tmp_path / name, meta, tensors)


def _reads(b: bytes) -> GGUFFile:
    return GGUFFile.from_buffer(b)


def test_small_file_reads_back(tmp_path):
    p = _small_gguf(tmp_path)
    with GGUFFile(p) as g:
        assert g.metadata["a.str"] == "héllo" and g.metadata["a.arr"] == [1, -2, 3]
        assert g.metadata["a.nested"] == [["x"], [], ["y", "z"]] and g.metadata["a.bool"] is True
        assert g.tensors["t.i32"].data.view("<i4").tolist() == list(range(6))
    r = GGUFReader(p)
    assert r.fields["a.str"].contents() == "héllo"


def test_tensor_numpy_decodes_float_and_int_types(tmp_path):
    from ds4ref.weights import Tensor
    x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)       # numpy order [rows, in]
    bf16 = (x.view(np.uint32) >> 16).astype("<u2")                                 # truncated bfloat16
    ts = [TensorData("f32", GGMLType.F32, (64, 3), lambda: [x]),
          TensorData("f16", GGMLType.F16, (64, 3), lambda: [x.astype("<f2")]),
          TensorData("bf16", GGMLType.BF16, (64, 3), lambda: [bf16]),
          TensorData("i32", GGMLType.I32, (64, 3), lambda: [np.arange(192, dtype="<i4")])]
    with GGUFFile(write_gguf(tmp_path / "types.gguf", [], ts)) as g:
        t = {n: Tensor.from_info(i) for n, i in g.tensors.items()}
        assert t["f32"].data.shape == (3, 256) and np.array_equal(t["f32"].numpy(), x)
        assert np.array_equal(t["f16"].numpy(), x.astype(np.float16).astype(np.float32))
        assert np.array_equal(t["bf16"].numpy(), (bf16.astype(np.uint32) << 16).view(np.float32))
        assert np.abs(t["bf16"].numpy() - x).max() <= np.abs(x).max() * 2 ** -7
        assert t["i32"].numpy().shape == (3, 64) and t["i32"].numpy()[2, 5] == 133


def _regions(g: GGUFFile, raw: bytes):
    """Byte offsets inside each region of a small file."""
    return {"header": 13, "metadata": raw.index(b"xxxx") + 100, "directory": g.header_nbytes - 10,
            "padding": g.header_nbytes + 1 if g.data_offset > g.header_nbytes + 1 else None,
            "data": g.tensors["t.q8"].offset + 10}


@pytest.mark.parametrize("region, message", [
    ("header", "header .*truncated"), ("metadata", "metadata key 'pad'.*truncated"),
    ("directory", "tensor .*truncated"), ("padding", "padding after the directory"),
    ("data", "beyond the end of the file")])
def test_truncation_in_every_region(tmp_path, region, message):
    p = _small_gguf(tmp_path, extra_meta=[("pad", (V.STRING,), "x" * 300 + "y" * 3)])
    raw = p.read_bytes()
    with GGUFFile(p) as g:
        cut = _regions(g, raw)[region]
        assert g.data_offset - g.header_nbytes > 1
    with pytest.raises(GGUFError, match=message):
        _reads(raw[:cut])
    (tmp_path / "cut.gguf").write_bytes(raw[:cut])
    with pytest.raises(GGUFError, match=message):
        GGUFFile(tmp_path / "cut.gguf")


def test_wrong_magic_and_version(tmp_path):
    raw = _small_gguf(tmp_path).read_bytes()
    with pytest.raises(GGUFError, match="bad magic b'GGML'"):
        _reads(b"GGML" + raw[4:])
    with pytest.raises(GGUFError, match="unsupported GGUF version 2"):
        _reads(raw[:4] + struct.pack("<I", 2) + raw[8:])


def test_empty_and_missing_files(tmp_path):
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(GGUFError, match="empty file"):
        GGUFFile(tmp_path / "empty.gguf")
    with pytest.raises(GGUFError, match="cannot open"):
        GGUFFile(tmp_path / "nope.gguf")


class _FsPath:
    """An os.PathLike whose __fspath__ gives `value` (bytes, an int, '')."""

    def __init__(self, value):
        self.value = value

    def __fspath__(self):
        return self.value

    def __repr__(self):
        return f"_FsPath({self.value!r})"


@pytest.mark.parametrize("path", [5, None, b"/x", "", _FsPath(b"/x"), _FsPath(7),
                                  _FsPath("")])
def test_a_path_that_is_no_str_or_is_empty_is_named(path):
    """An int would name a file descriptor, bytes an encoding, '' the current directory;
    an os.PathLike counts by what its __fspath__ gives."""
    got = repr(path)
    for door in (GGUFFile, load_model, ds4ref.model_summary):
        with pytest.raises(GGUFError, match=re.escape(
                f"path: expected a file path (str or os.PathLike), got {got}")):
            door(path)


def test_a_device_is_not_a_regular_file():
    """/dev/zero has size 0 and maps no file: refused by its kind, not as an empty GGUF."""
    with pytest.raises(GGUFError, match="/dev/zero: not a regular file"):
        GGUFFile("/dev/zero")


def test_a_fifo_is_refused_before_open(tmp_path):
    """open() on a FIFO waits for a writer: each door that takes a model path refuses it
    first. Run in subprocesses with a timeout, so a regression fails instead of hanging."""
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    code = """if True:
        import sys
        import ds4ref
        from ds4ref.gguf import GGUFError
        for door in (ds4ref.GGUFFile, ds4ref.load_model, ds4ref.model_summary,
                     lambda p: ds4ref.Engine.open(p, backend="numpy"),
                     lambda p: ds4ref.Engine.open(backend="numpy", mtp_path=p)):
            try:
                door(sys.argv[1])
            except GGUFError as e:
                print(e)
    """
    r = subprocess.run([sys.executable, "-c", code, str(fifo)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout == f"{fifo}: not a regular file (a FIFO, a device or a socket)\n" * 5
    r = subprocess.run([sys.executable, "-m", "ds4ref", "--backend", "numpy", "--summary",
                        "-m", str(fifo)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr == (
        f"python -m ds4ref: error: {fifo}: not a regular file (a FIFO, a device or a "
        "socket)\n"), r.stderr


@pytest.mark.parametrize("buf, got", [
    (None, "NoneType"), (5, "int"), ("GGUF", "str"),
    (memoryview(b"GGUF" * 8)[::2], "memoryview, not C-contiguous"),
    (np.zeros((4, 4), np.uint8)[:, ::2], "ndarray, not C-contiguous"),
])
def test_from_buffer_names_what_it_takes(buf, got):
    with pytest.raises(GGUFError, match=re.escape(
            f"buf: expected a bytes-like, C-contiguous buffer (bytes, bytearray, a numpy "
            f"array), got {got}")):
        GGUFFile.from_buffer(buf)


def test_from_buffer_reads_every_contiguous_bytes_like(oracle_gguf):
    raw = open(oracle_gguf, "rb").read()
    for buf in (raw, bytearray(raw), np.frombuffer(raw, np.uint8), memoryview(raw)):
        assert len(GGUFFile.from_buffer(buf).tensors) == len(GGUFReader(oracle_gguf).tensors)


@pytest.mark.parametrize("patch_at, value, message", [
    (8, 2**62, "claims .* tensors, which cannot fit"),                 # tensor count
    (16, 2**63, "claims .* metadata keys"),                             # metadata count
    (24, 2**60, "metadata key #0 \\(length\\): .*|metadata key #0: truncated"),  # key length
])
def test_absurd_counts_fail_fast(tmp_path, patch_at, value, message):
    raw = bytearray(_small_gguf(tmp_path).read_bytes())
    raw[patch_at:patch_at + 8] = struct.pack("<Q", value)
    with pytest.raises(GGUFError, match=message):
        _reads(bytes(raw))


def test_absurd_array_and_string_lengths_fail_fast(tmp_path):
    p = _small_gguf(tmp_path)
    raw = bytearray(p.read_bytes())
    # the a.arr entry: key, type u32 (9), item type u32 (INT16), length u64
    i = raw.index(b"a.arr") + len("a.arr") + 4 + 4
    raw[i:i + 8] = struct.pack("<Q", 2**61)
    with pytest.raises(GGUFError, match="metadata key 'a.arr' .*truncated"):
        _reads(bytes(raw))
    raw = bytearray(p.read_bytes())
    i = raw.index(b"a.str") + len("a.str") + 4
    raw[i:i + 8] = struct.pack("<Q", 2**40)
    with pytest.raises(GGUFError, match="metadata key 'a.str'.*truncated"):
        _reads(bytes(raw))
    raw = bytearray(p.read_bytes())
    i = raw.index(b"a.nested") + len("a.nested") + 4 + 4
    raw[i:i + 8] = struct.pack("<Q", 2**50)
    with pytest.raises(GGUFError, match="metadata key 'a.nested' .*items"):
        _reads(bytes(raw))


NEST_ITEMS = [(t, (t,), True if t == V.BOOL else 1) for t in V
              if t not in (V.STRING, V.ARRAY)]
NEST_ITEMS += [(V.STRING, (V.STRING,), "x"), (V.ARRAY, (V.ARRAY, V.UINT8), [])]


def _nested(levels: int, item_vtype: tuple, item):
    value, vtype = [item], (V.ARRAY,) + item_vtype
    for _ in range(levels - 1):
        value, vtype = [value], (V.ARRAY,) + vtype
    return value, vtype


@pytest.mark.parametrize("levels", [8, 9, 10])
@pytest.mark.parametrize("item_type, item_vtype, item", NEST_ITEMS,
                         ids=[t.name for t, _, _ in NEST_ITEMS])
def test_nesting_is_bounded_as_ds4c_skip_value(tmp_path, levels, item_type, item_vtype, item):
    """ds4.c's skip_value (l. 952) refuses a value it visits inside more than 8 arrays; it visits
    strings and arrays one by one but skips an array's numbers as one block. So an item inside 8
    arrays always reads; inside 9 only numbers do (their array is inside 8); inside 10 nothing."""
    value, vtype = _nested(levels, item_vtype, item)
    p = _small_gguf(tmp_path, extra_meta=[("deep", vtype, value)])
    if levels == 8 or (levels == 9 and item_type not in (V.STRING, V.ARRAY)):
        with GGUFFile(p) as g:
            assert g.metadata["deep"] == value and g.metadata_types["deep"] == vtype
    else:
        with pytest.raises(GGUFError, match=r"metadata key 'deep'(\[0\])+: metadata value "
                                            r"nested (9|10) arrays deep \(at most 8\)"):
            GGUFFile(p)


def test_nine_arrays_of_empty_string_arrays_read_as_in_ds4c(tmp_path):
    """ds4.c visits no string of an empty string array, so its depth is never checked."""
    value, vtype = _nested(9, (V.STRING,), "x")
    inner = value
    for _ in range(8):
        inner = inner[0]
    inner.clear()                                    # the innermost array is now empty
    p = _small_gguf(tmp_path, extra_meta=[("deep", vtype, value)])
    with GGUFFile(p) as g:
        assert g.metadata["deep"] == value


def test_bad_metadata_values(tmp_path):
    raw = _small_gguf(tmp_path).read_bytes()
    i = raw.index(b"a.bool") + len("a.bool")
    with pytest.raises(GGUFError, match="'a.bool': bool value 2"):
        _reads(raw[:i + 4] + b"\x02" + raw[i + 5:])
    with pytest.raises(GGUFError, match="'a.bool': unknown metadata value type 13"):
        _reads(raw[:i] + struct.pack("<I", 13) + raw[i + 4:])
    j = raw.index("héllo".encode())
    with pytest.raises(GGUFError, match="'a.str': string is not valid UTF-8"):
        _reads(raw[:j + 1] + b"\xff" + raw[j + 2:])
    with pytest.raises(GGUFError, match="'general.alignment': expected type UINT32, got STRING"):
        write_gguf(tmp_path / "al.gguf", [("general.alignment", (V.STRING,), "32")], [])
        GGUFFile(tmp_path / "al.gguf")


def test_string_arrays_are_read_fast_and_fail_at_the_bad_element(tmp_path):
    """Cursor.strings reads a whole string array in one loop; a bad element still gets
    string()'s error, naming the element."""
    words = ["ab", "wörd" * 8, "", "cd"]
    meta = [("a.sarr", (V.ARRAY, V.STRING), words)]
    raw = _small_gguf(tmp_path, extra_meta=meta).read_bytes()
    assert _reads(raw).metadata["a.sarr"] == words
    j = raw.index("wörd".encode())
    with pytest.raises(GGUFError, match=r"'a.sarr'\[1\]: string is not valid UTF-8 "
                                        rf"\(invalid start byte at byte {j + 1}\)"):
        _reads(raw[:j + 1] + b"\xff" + raw[j + 2:])
    k = raw.index(struct.pack("<Q", 2) + b"cd")
    with pytest.raises(GGUFError, match=r"'a.sarr'\[3\] \(length\): truncated GGUF"):
        _reads(raw[:k + 4])
    huge = rf"'a.sarr'\[3\]: truncated GGUF file, needs {2**40} bytes"
    with pytest.raises(GGUFError, match=huge):
        _reads(raw[:k] + struct.pack("<Q", 2**40) + raw[k + 8:])


def test_duplicate_keys_and_tensor_names(tmp_path):
    with pytest.raises(GGUFError, match="metadata key 'a.u8': duplicate key"):
        GGUFFile(_small_gguf(tmp_path, extra_meta=[("a.u8", (V.UINT8,), 1)]))
    t = TensorData("t.f32", GGMLType.F32, (5,), lambda: [np.zeros(5, "<f4")])
    with pytest.raises(GGUFError, match="tensor 't.f32': duplicate tensor name"):
        GGUFFile(_small_gguf(tmp_path, tensors=[t, t], name="dup.gguf"))


def _directory_offset_pos(raw: bytes, name: str) -> int:
    i = raw.index(name.encode() + b"")  # name bytes, then ndim u32, dims u64s, type u32, offset u64
    ndim = struct.unpack_from("<I", raw, i + len(name))[0]
    return i + len(name) + 4 + 8 * ndim + 4


def test_misaligned_and_out_of_file_tensor_offsets(tmp_path):
    raw = bytearray(_small_gguf(tmp_path).read_bytes())
    pos = _directory_offset_pos(raw, "t.i32")
    rel = struct.unpack_from("<Q", raw, pos)[0]
    bad = bytes(raw[:pos]) + struct.pack("<Q", rel + 4) + bytes(raw[pos + 8:])
    with pytest.raises(GGUFError, match="tensor 't.i32': offset .* not a multiple of the alignment 32"):
        _reads(bad)
    bad = bytes(raw[:pos]) + struct.pack("<Q", rel + 2**20) + bytes(raw[pos + 8:])
    with pytest.raises(GGUFError, match="tensor 't.i32': data .* beyond the end of the file"):
        _reads(bad)
    bad = bytes(raw[:pos]) + struct.pack("<Q", 0) + bytes(raw[pos + 8:])
    with pytest.raises(GGUFError, match="tensor 't.i32': data overlaps tensor 't.f32'"):
        _reads(bad)


def test_bad_tensor_directory_entries(tmp_path):
    raw = bytes(_small_gguf(tmp_path).read_bytes())
    pos = _directory_offset_pos(raw, "t.f32") - 4
    with pytest.raises(GGUFError, match="tensor 't.f32': unknown ggml type 99"):
        _reads(raw[:pos] + struct.pack("<I", 99) + raw[pos + 4:])
    i = raw.index(b"t.f32") + 5
    with pytest.raises(GGUFError, match="tensor 't.f32': 9 dimensions"):
        _reads(raw[:i] + struct.pack("<I", 9) + raw[i + 4:])
    j = raw.index(b"t.q8") + 4 + 4
    with pytest.raises(GGUFError, match="tensor 't.q8': dim 0 = 33 is not a multiple of the Q8_0 block"):
        _reads(raw[:j] + struct.pack("<Q", 33) + raw[j + 8:])


# semantic errors: a DS4 file with one thing wrong ------------------------------------

def _micro_variant(tmp_path, meta_edit=None, tensor_edit=None):
    meta = model_metadata(MICRO, seed=3)
    tensors = model_tensors(MICRO, seed=3)
    if meta_edit:
        meta = meta_edit(meta)
    if tensor_edit:
        tensors = tensor_edit(tensors)
    return write_gguf(tmp_path / "variant.gguf", meta, tensors)


def _drop_key(key):
    return lambda meta: [m for m in meta if m[0] != key]


def _set_key(key, vtype, value):
    return lambda meta: [(k, vtype, value) if k == key else (k, t, v) for k, t, v in meta]


def _rename(name, new):
    return lambda tensors: [dataclasses.replace(t, name=new) if t.name == name else t
                            for t in tensors]


def _retype(name, ggml_type, shape=None):
    def edit(tensors):
        out = []
        for t in tensors:
            if t.name == name:
                shp = shape or t.shape
                n = TensorData(name, ggml_type, shp, None).nbytes
                t = TensorData(name, ggml_type, shp, lambda n=n: [np.zeros(n, np.uint8)])
            out.append(t)
        return out
    return edit


@pytest.mark.parametrize("meta_edit, tensor_edit, message", [
    (_drop_key("deepseek4.expert_count"), None, "'deepseek4.expert_count': required key is missing"),
    (_drop_key("tokenizer.ggml.merges"), None, "'tokenizer.ggml.merges': required key is missing"),
    (_set_key("deepseek4.block_count", (V.STRING,), "3"), None, "'deepseek4.block_count': expected type UINT32, got STRING"),
    (_set_key("deepseek4.block_count", (V.UINT32,), 2), None, "'blk.2.hc_attn_fn.weight': layer 2 is outside the model's 2 layers"),
    (_set_key("deepseek4.expert_weights_norm", (V.BOOL,), False), None, "'deepseek4.expert_weights_norm': expected true"),
    (_set_key("deepseek4.expert_weights_norm", (V.UINT8,), 1), None, "expected type BOOL, got UINT8"),
    (_set_key("deepseek4.attention.compress_ratios", (V.ARRAY, V.UINT32), [0, 0, 128]), None, "layer 2 has ratio 128, ds4 requires 4"),
    (_set_key("deepseek4.attention.compress_ratios", (V.ARRAY, V.INT32), [0, -1, 4]), None, "negative"),
    (_set_key("deepseek4.attention.compress_ratios", (V.ARRAY, V.UINT32), [0, 0]), None, "2 entries, shorter than the 3 layers"),
    (_set_key("deepseek4.attention.compress_ratios", (V.ARRAY, V.FLOAT32), [0, 0, 4]), None, "expected type ARRAY/UINT32 or ARRAY/INT32, got ARRAY/FLOAT32"),
    (_set_key("deepseek4.swiglu_clamp_exp", (V.ARRAY, V.FLOAT32), [10, 10, 9]), None, r"swiglu_clamp_exp\[2\]': expected 10, got 9"),
    (_set_key("deepseek4.expert_weights_scale", (V.FLOAT32,), 1.25), None, "'deepseek4.expert_weights_scale': expected 1.5, got 1.25"),
    (lambda m: m + [("deepseek4.expert_group_count", (V.UINT32,), 8)], None, "'deepseek4.expert_group_count': expected 0"),
    (_set_key("tokenizer.ggml.tokens", (V.ARRAY, V.STRING), ["a"] * 300), None, "required token '<｜begin▁of▁sentence｜>' is missing"),
    (_set_key("general.architecture", (V.STRING,), "llama"), None, "'general.architecture': expected 'deepseek4', got 'llama'"),
    (_set_key("general.architecture", (V.UINT32,), 4), None, "'general.architecture': expected a STRING, got UINT32"),
    (_drop_key("general.architecture"), None, "'general.architecture': required key is missing"),
    (_set_key("deepseek4.hyper_connection.sinkhorn_iterations", (V.UINT32,), 2**31), None,
     "'deepseek4.hyper_connection.sinkhorn_iterations': expected 20 as ds4.c, got 2147483648"),
    (_set_key("deepseek4.attention.sliding_window", (V.UINT32,), 2**32 - 1), None,
     "'deepseek4.attention.sliding_window': 4294967295 is more than ds4.c's 128"),
    (lambda m: _set_key("tokenizer.ggml.tokens", (V.ARRAY, V.STRING),
                        dict((k, v) for k, _, v in m)["tokenizer.ggml.tokens"] + ["extra"])(m),
     None, "'tokenizer.ggml.tokens': 301 tokens, but deepseek4.vocab_size is 300"),
    (None, _rename("blk.2.exp_probs_b.bias", "blk.².exp_probs_b.bias"),
     "tensor 'blk.².exp_probs_b.bias': layer number '²' is not written in ASCII digits"),
    (None, _rename("blk.2.exp_probs_b.bias", "blk.x.exp_probs_b.bias"),
     "tensor 'blk.x.exp_probs_b.bias': layer number 'x' is not written in ASCII digits"),
    (None, _rename("blk.2.exp_probs_b.bias", "blk.99999999999999999999.exp_probs_b.bias"),
     "layer 99999999999999999999 is outside the model's 3 layers"),
    (None, lambda ts: [t for t in ts if t.name != "blk.2.indexer.proj.weight"], "tensor 'blk.2.indexer.proj.weight': required tensor is missing"),
    (None, lambda ts: [t for t in ts if t.name != "blk.0.ffn_gate_tid2eid.weight"], "tensor 'blk.0.ffn_gate_tid2eid.weight': required tensor is missing"),
    (None, _retype("blk.1.attn_q_b.weight", GGMLType.F16), "tensor 'blk.1.attn_q_b.weight': expected type Q8_0, got F16"),
    (None, _retype("blk.2.attn_kv.weight", GGMLType.Q8_0, (256, 128)), r"tensor 'blk.2.attn_kv.weight': expected shape \[256, 192\], got \[256, 128\]"),
    (None, _retype("blk.0.ffn_down_exps.weight", GGMLType.Q8_0), "expected type one of Q2_K/IQ2_XXS/Q4_K, got Q8_0"),
    (None, _retype("blk.0.ffn_up_exps.weight", GGMLType.Q4_K), "'blk.0.ffn_up_exps.weight': type Q4_K differs from ffn_gate_exps"),
    (None, _retype("token_embd.weight", GGMLType.F16, (256, 301)), r"'token_embd.weight': expected shape \[256, 300\]"),
])
def test_ds4_validation_errors_name_the_key_or_tensor(tmp_path, meta_edit, tensor_edit, message):
    p = _micro_variant(tmp_path, meta_edit, tensor_edit)
    with pytest.raises(GGUFError, match=message.replace("(", r"\(").replace(")", r"\)") if "\\" not in message else message):
        load_model(p)


def test_optional_router_bias_may_be_absent(tmp_path):
    p = write_gguf(tmp_path / "nobias.gguf", model_metadata(MICRO, 3), model_tensors(MICRO, 3, exp_probs_b=False))
    g, cfg, w = load_model(p)
    with g:
        assert all(l.ffn_exp_probs_b is None for l in w.layers)


# property: mutated files raise GGUFError or load, nothing else ----------------------

@pytest.fixture(scope="module")
def micro_bytes(tmp_path_factory):
    cfg = dataclasses.replace(MICRO, n_vocab=264)
    p = write_gguf(tmp_path_factory.mktemp("prop") / "m.gguf", model_metadata(cfg, 1), model_tensors(cfg, 1))
    with GGUFFile(p) as g:
        return p.read_bytes(), g.header_nbytes


def _load_from_bytes(b: bytes) -> None:
    g = GGUFFile.from_buffer(b)
    check_tokenizer_metadata(g)
    bind_weights(g, ModelConfig.from_gguf(g))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_files_raise_only_gguf_error(micro_bytes, data):
    raw, head = micro_bytes
    b = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 4), label="n_mutations")):
        where = data.draw(st.one_of(st.integers(0, head + 64), st.integers(0, len(b))), label="position")
        kind = data.draw(st.sampled_from(["flip", "set", "truncate", "insert", "delete"]), label="kind")
        where = min(where, len(b))
        if kind == "flip" and where < len(b):
            b[where] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "set" and where < len(b):
            b[where] = data.draw(st.sampled_from([0x00, 0x01, 0x09, 0x7F, 0x80, 0xFF]))
        elif kind == "truncate":
            del b[where:]
        elif kind == "insert":
            b[where:where] = data.draw(st.binary(min_size=1, max_size=16))
        elif kind == "delete":
            del b[where:where + data.draw(st.integers(1, 16))]
    try:
        _load_from_bytes(bytes(b))
    except GGUFError:
        pass


def test_warm_pages_touches_every_page_of_the_tensor_data(oracle_gguf):
    """GGUFFile.warm_pages (ds4.c: model_warm_weights) reads one byte per page from the data offset on; a file
    parsed from a buffer has nothing mapped."""
    import mmap
    with GGUFFile(oracle_gguf) as g:
        n = g.warm_pages()
        assert n == -(-(g.size - g.data_offset) // mmap.PAGESIZE) and n > 3000
    assert GGUFFile.from_buffer(oracle_gguf.read_bytes()).warm_pages() == 0



# --------------------------------------------------- the real shape, as a sparse file

def test_hole_mode_writes_the_same_header_and_no_data(tmp_path):
    """data="hole": the file data="random" writes, every tensor byte a zeroed hole."""
    full = write_model(tmp_path / "full.gguf", MICRO, seed=3, name="same")
    hole = write_model(tmp_path / "hole.gguf", MICRO, seed=3, name="same", data="hole")
    with GGUFFile(full) as g:
        start = g.data_offset
    a, b = full.read_bytes(), hole.read_bytes()
    assert len(a) == len(b) and a[:start] == b[:start]
    assert not any(b[start:]) and any(a[start:])
    with pytest.raises(ValueError, match="data must be 'random' or 'hole'"):
        write_model(tmp_path / "x.gguf", MICRO, data="zeros")


def test_hole_mode_refuses_a_filesystem_without_holes(tmp_path, monkeypatch):
    import ds4ref.dev.writer as writer
    monkeypatch.setattr(writer, "sparse_files_supported", lambda d: False)
    with pytest.raises(writer.SparseFileError, match="does not support sparse files"):
        write_model(tmp_path / "x.gguf", MICRO, data="hole")
    assert not list(tmp_path.iterdir())


@pytest.fixture(scope="module")
def real_hole(tmp_path_factory):
    """The real shape's header and directory in a sparse file: 86.7 GB, 6 MB on disk."""
    from ds4ref.dev.writer import sparse_files_supported
    d = tmp_path_factory.mktemp("real_hole")
    if not sparse_files_supported(d):
        pytest.skip(f"the filesystem of {d} does not support sparse files (holes): "
                    "the real-shape file would take its full 86.7 GB of disk")
    t0 = time.perf_counter()
    p = write_model(d / "real.gguf", ModelConfig.real(), data="hole")
    yield p, time.perf_counter() - t0
    p.unlink()                 # leave no 86.7 GB (apparent) file in pytest's tmp dirs


def _real_data_bytes():
    """Bytes of tensor data of the real q2 model, from ds4.c's layout (tensor_specs)."""
    real, total = ModelConfig.real(), 0
    experts = {"ffn_gate_exps": GGMLType.IQ2_XXS, "ffn_up_exps": GGMLType.IQ2_XXS,
               "ffn_down_exps": GGMLType.Q2_K}
    for s in tensor_specs(real):
        if s.optional and s.il < real.n_hash_layer:
            continue                               # the router bias: top-k layers only
        t = experts.get(s.field, s.types[0])
        total += type_nbytes(t, int(np.prod(s.shape, dtype=object)))
    return total


def test_real_shape_file_costs_few_disk_blocks(real_hole):
    p, seconds = real_hole
    st = os.stat(p)
    with GGUFFile(p) as g:
        header = g.data_offset
    assert round(st.st_size / 1e9, 1) == 86.7
    # the data region is the tensors' bytes plus alignment padding (< 32 bytes each)
    assert 0 <= st.st_size - header - _real_data_bytes() < 32 * 1328
    assert header < 8e6 and st.st_blocks * 512 < 16e6    # the header (6.2 MB), no data
    assert seconds < 30


def test_real_shape_binds_every_tensor_as_ds4c_and_gguf_py_read_it(real_hole):
    p, _ = real_hole
    T = GGMLType
    g, cfg, w = load_model(p)
    with g:
        assert cfg == ModelConfig.real()
        assert len(w.layers) == 43 and len(w.tensors()) == len(g.tensors) == 1328
        assert (w.token_embd.ggml_type, w.token_embd.shape) == (T.F16, (4096, 129280))
        assert (w.output.ggml_type, w.output.shape) == (T.Q8_0, (4096, 129280))
        for lw in w.layers:
            assert lw.attn_q_b.ggml_type == lw.ffn_down_shexp.ggml_type == T.Q8_0
            assert lw.ffn_gate_exps.ggml_type == lw.ffn_up_exps.ggml_type == T.IQ2_XXS
            assert lw.ffn_down_exps.ggml_type == T.Q2_K
            assert lw.ffn_gate_exps.shape == (4096, 2048, 256)
            assert lw.ffn_down_exps.shape == (2048, 4096, 256)
            assert (lw.ffn_gate_tid2eid is not None) == (lw.il < 3)
            assert (lw.indexer_proj is not None) == (cfg.compress_ratio(lw.il) == 4)
        last = w.layers[42].ffn_down_exps              # offsets far beyond 32 bits
        assert last.offset > 2**36 and last.data.shape == (4096 * 256, 2048 // 256 * 84)
        e = last.expert(255)
        assert e.offset + e.nbytes == last.offset + last.nbytes
        # gguf-py reads the same directory and metadata on its own
        r = GGUFReader(p)
        assert r.data_offset == g.data_offset
        assert [t.name for t in r.tensors] == list(g.tensors)
        for t in r.tensors:
            m = g.tensors[t.name]
            theirs = (int(t.tensor_type), tuple(int(d) for d in t.shape), t.data_offset,
                      t.n_bytes)
            assert (m.ggml_type, m.shape, m.offset, m.nbytes) == theirs, t.name
        for key, f in r.fields.items():
            if key.startswith(("deepseek4.", "general.")):
                assert g.metadata[key] == f.contents(), key
        assert len(r.fields["tokenizer.ggml.tokens"].data) == 129280


_LOAD_PROBE = r"""
import json, os, re, resource, sys, time

def status(key):
    try:
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ":"))
    except (OSError, StopIteration):
        return None

def reset_peak():
    # Linux: writing 5 to clear_refs resets VmHWM to the current RSS
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass

def peak():
    hwm = status("VmHWM")
    if hwm is not None:
        return hwm
    p = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return p if sys.platform == "darwin" else p * 1024

def mapped(path):
    # resident bytes of the mappings of `path` (Linux /proc/self/smaps; None elsewhere)
    try:
        lines = open("/proc/self/smaps").read().splitlines()
    except OSError:
        return None
    total, mine = 0, False
    for line in lines:
        if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
            mine = line.split(maxsplit=5)[-1] == path
        elif mine and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total

from ds4ref.weights import load_model
path = os.path.realpath(sys.argv[1])
reset_peak()
r0, p0, t0 = status("VmRSS"), peak(), time.perf_counter()
g, cfg, w = load_model(path)
seconds = time.perf_counter() - t0
r1 = status("VmRSS")
print(json.dumps(dict(seconds=seconds, rss_growth=None if r0 is None else r1 - r0,
                      peak_growth=peak() - p0, mapped=mapped(path),
                      header=g.data_offset, size=g.size, n_layer=cfg.n_layer,
                      n_tensors=len(w.tensors()))))
"""


def test_real_shape_loads_in_seconds_without_reading_the_data(real_hole):
    """load_model maps the 86.7 GB file and reads only its header (new process)."""
    p, _ = real_hole
    out = subprocess.run([sys.executable, "-c", _LOAD_PROBE, str(p)], check=True,
                         capture_output=True, text=True, timeout=120).stdout
    m = json.loads(out)
    assert (m["n_layer"], m["n_tensors"], m["size"]) == (43, 1328, os.stat(p).st_size)
    assert m["seconds"] < 10                  # 0.6-1.5 s on a shared 2-core VM
    assert m["peak_growth"] < 200e6           # ~35 MB: metadata, 129280 token strings
    if m["rss_growth"] is not None:
        assert m["rss_growth"] < 200e6        # ~30 MB
    if m["mapped"] is not None:               # the file's pages in our page tables: the
        assert m["mapped"] < m["header"] + 16e6   # header (+ the kernel's fault-around)


def test_real_shape_summary_from_the_command_line(real_hole):
    p, _ = real_hole
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "ds4ref", "-m", str(p), "--summary"],
                       capture_output=True, text=True, timeout=120)
    seconds = time.perf_counter() - t0
    assert r.returncode == 0, r.stderr
    s = r.stdout
    assert "ds4ref-directory-only (deepseek4), GGUF v3" in s and "1328 tensors" in s
    assert "43 layers, n_embd 4096, vocab 129280, 64 heads x 512" in s
    assert "256 routed (6 per token, hidden 2048)" in s
    data_mb = f"{_real_data_bytes() / 1e6:,.2f}"
    assert f"({data_mb} MB of tensor data, file 86,7" in s           # 86.7 GB
    assert re.search(r"IQ2_XXS +86 tensors +47,613\.74 MB", s)
    assert re.search(r"Q2_K +43 tensors", s) and re.search(r"Q8_0 +345 tensors", s)
    assert seconds < 30

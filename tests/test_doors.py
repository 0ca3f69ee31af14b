"""Every door named: each public entry point refuses each bad argument with a named
ds4ref error that says what was wrong and what is allowed, and leaves the session as it
was; the CLI prints one line and exits 2. One table row per (entry point, bad argument)."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from ds4ref.__main__ import CLIError, main
from ds4ref.backend import BackendError
from ds4ref.engine import Engine, EngineError
from ds4ref.gguf import DS4RefError, GGUFError
from ds4ref.mtp import MTPError
from ds4ref.sample import SampleRNG, SamplingError, argmax_excluding, sample, token_logprob
from ds4ref import data_path
from ds4ref.session import (ContextOverflowError, EmptyPromptError, SessionError, Snapshot,
                            TokenRangeError)
from ds4ref.steering import SteeringError
from ds4ref.tokenizer import TokenizerError, think_mode_for_context

NAN = float("nan")


@pytest.fixture(scope="module")
def door(tmp_path_factory):
    """The bundled model on numpy (its MTP file too), a session of ctx 32 holding 3
    tokens, and a few files to hand over."""
    d = tmp_path_factory.mktemp("doors")
    eng = Engine.open(backend="numpy")
    s = eng.session(32)
    s.sync([1, 2, 3])
    (d / "empty.gguf").write_bytes(b"")
    (d / "junk.npz").write_bytes(b"not a zip file")
    (d / "short.f32").write_bytes(b"\0" * 12)
    s.save(d / "s32.npz")
    other = eng.session(16)
    other.sync([1, 2])
    other.save(d / "s16.npz")
    (d / "text.txt").write_text("hello\n")
    # a model of the same shape with other weights, its session at the same place
    b = Engine.open(data_path("oracle", "dev_seed1.gguf"), backend="numpy").session(32)
    b.sync([1, 2, 3])
    b.save(d / "other_model.npz")
    return SimpleNamespace(eng=eng, s=s, tok=eng.tokenizer, d=d, V=eng.cfg.n_vocab,
                           other=b)


def _forged(door, edit) -> str:
    """A copy of the ctx-32 session file with `edit(arrays, header)` applied."""
    with np.load(door.d / "s32.npz") as z:
        arrays = {k: z[k] for k in z.files}
    header = json.loads(bytes(arrays.pop("header")).decode())
    edit(arrays, header)
    arrays["header"] = np.frombuffer(json.dumps(header).encode(), np.uint8)
    path = door.d / "forged.npz"
    np.savez(path, **arrays)
    return path


def _set(key, value):
    def edit(arrays, header):
        (header if key in header else arrays)[key] = value
    return edit


def _drop(key):
    return lambda arrays, header: arrays.pop(key)


def _add(key):
    return lambda arrays, header: arrays.__setitem__(key, np.zeros(1, np.float32))


V = 1024          # the bundled model's vocabulary
# (entry point, call on the fixture, expected error class, fragment of its message)
class _BytesPath:
    """An os.PathLike whose __fspath__ gives bytes, which pathlib cannot take."""

    def __fspath__(self):
        return b"/tmp/x.gguf"

    def __repr__(self):
        return "_BytesPath()"


DOORS = [
    # Engine.open
    ("Engine.open", lambda c: Engine.open(backend=None), BackendError,
     "backend: expected a name ('auto', 'numpy', 'numba', ...) or a backend object, got None"),
    ("Engine.open", lambda c: Engine.open(backend=42), BackendError, "got 42"),
    ("Engine.open", lambda c: Engine.open(backend="nosuch"), BackendError,
     "backend 'nosuch': unknown; choose one of"),
    ("Engine.open", lambda c: Engine.open(123, backend="numpy"), EngineError,
     "path: expected a file path (str or os.PathLike), got 123"),
    ("Engine.open", lambda c: Engine.open("", backend="numpy"), EngineError, "got ''"),
    ("Engine.open", lambda c: Engine.open(_BytesPath(), backend="numpy"), EngineError,
     "path: expected a file path (str or os.PathLike), got _BytesPath()"),
    ("Engine.open", lambda c: Engine.open("/nonexistent/x.gguf", backend="numpy"), GGUFError,
     "cannot open: No such file or directory"),
    ("Engine.open", lambda c: Engine.open(c.d, backend="numpy"), GGUFError,
     "cannot open: Is a directory"),
    ("Engine.open", lambda c: Engine.open(c.d / "empty.gguf", backend="numpy"), GGUFError,
     "empty file, not a GGUF"),
    ("Engine.open", lambda c: Engine.open(backend="numpy", resident="yes"), EngineError,
     "resident: expected True or False, got 'yes'"),
    ("Engine.open", lambda c: Engine.open(backend="numpy", resident=True), BackendError,
     "resident=True: backend 'numpy' computes on host arrays"),
    ("Engine.open", lambda c: Engine.open(backend="numpy", ctx_size=0), SessionError,
     "ctx_size: expected an integer >= 2, got 0"),
    ("Engine.open", lambda c: Engine.open(backend="numpy", ctx_size=2.9), SessionError,
     "ctx_size: expected an integer >= 2, got 2.9"),
    ("Engine.open", lambda c: Engine.open(backend="numpy", ctx_size=-5), SessionError,
     "got -5"),
    ("Engine.open", lambda c: Engine.open(backend="numpy", ctx_size=True), SessionError,
     "got True"),
    ("Engine.open", lambda c: Engine.open(backend="numpy", ctx_size=2**40),
     ContextOverflowError, "GiB (limit 16 GiB, MAX_CACHE_BYTES)"),
    ("Engine.open", lambda c: Engine.open(backend="numpy", mtp_draft_tokens=0), MTPError,
     "mtp_draft_tokens: expected an integer in [1, 16], got 0"),
    ("Engine.open", lambda c: Engine.open(backend="numpy", mtp_draft_tokens=-3), MTPError,
     "got -3"),
    ("Engine.open", lambda c: Engine.open(backend="numpy", mtp_draft_tokens=17), MTPError,
     "got 17"),
    ("Engine.open", lambda c: Engine.open(backend="numpy", mtp_draft_tokens=2.5), MTPError,
     "got 2.5"),
    ("Engine.open", lambda c: Engine.open(backend="numpy", mtp_margin=-1), MTPError,
     "mtp_margin: expected a finite number in [0, 1000], got -1"),
    ("Engine.open", lambda c: Engine.open(backend="numpy", mtp_margin=NAN), MTPError, "nan"),
    ("Engine.open", lambda c: Engine.open(backend="numpy", mtp_margin="3"), MTPError, "'3'"),
    ("Engine.open", lambda c: Engine.open(backend="numpy", mtp_path=5), MTPError,
     "mtp_path: expected a file path"),
    ("Engine.open", lambda c: Engine.open(backend="numpy", mtp_path=c.d / "empty.gguf"),
     GGUFError, "empty file"),
    ("Engine.open", lambda c: Engine.open(backend="numpy", steering_attn=NAN), SteeringError,
     "steering_attn: expected a finite number in [-100, 100], got nan"),
    ("Engine.open", lambda c: Engine.open(backend="numpy", steering_attn=1e9), SteeringError,
     "got 1000000000.0"),
    ("Engine.open", lambda c: Engine.open(backend="numpy", steering_ffn=True), SteeringError,
     "steering_ffn: expected a finite number in [-100, 100], got True"),
    ("Engine.open", lambda c: Engine.open(backend="numpy", steering_attn=0.5), SteeringError,
     "directional steering needs steering_file"),
    ("Engine.open", lambda c: Engine.open(backend="numpy", steering_file=7), SteeringError,
     "steering_file: expected a file path"),
    ("Engine.open", lambda c: Engine.open(backend="numpy", steering_file="/nonexistent"),
     SteeringError, "cannot read it"),
    ("Engine.open", lambda c: Engine.open(backend="numpy", steering_file=c.d / "short.f32"),
     SteeringError, "has size 12 bytes, expected 6144 bytes (float32 [6, 256])"),
    # Engine.session
    ("Engine.session", lambda c: c.eng.session(0), SessionError,
     "ctx_size: expected an integer >= 2, got 0"),
    ("Engine.session", lambda c: c.eng.session(2.9), SessionError, "got 2.9"),
    ("Engine.session", lambda c: c.eng.session(-1), SessionError, "got -1"),
    ("Engine.session", lambda c: c.eng.session("64"), SessionError, "got '64'"),
    ("Engine.session", lambda c: c.eng.session(2**40), ContextOverflowError, "GiB"),
    ("Engine.session", lambda c: c.eng.session(16, force_decisions=[1]), SessionError,
     "force_decisions: expected a dict of recorded decisions or None, got list"),
    # Session.sync
    ("Session.sync", lambda c: c.s.sync([]), EmptyPromptError, "the prompt is empty"),
    ("Session.sync", lambda c: c.s.sync([[1, 2]]), SessionError,
     "expected a 1-D sequence of ids, got shape (1, 2)"),
    ("Session.sync", lambda c: c.s.sync([[1], [2, 3]]), SessionError,
     "tokens: not a sequence of ids"),
    ("Session.sync", lambda c: c.s.sync(None), SessionError, "got shape ()"),
    ("Session.sync", lambda c: c.s.sync("abc"), SessionError, "got shape ()"),
    ("Session.sync", lambda c: c.s.sync([1.5]), TokenRangeError,
     "expected integer ids, got dtype float64"),
    ("Session.sync", lambda c: c.s.sync([True]), TokenRangeError, "got dtype bool"),
    ("Session.sync", lambda c: c.s.sync([2**70]), TokenRangeError, "got dtype object"),
    ("Session.sync", lambda c: c.s.sync([1, -1]), TokenRangeError,
     "tokens[1] = -1: out of range [0, 1024)"),
    ("Session.sync", lambda c: c.s.sync([V]), TokenRangeError, "= 1024: out of range"),
    ("Session.sync", lambda c: c.s.sync([1] * 32), ContextOverflowError,
     "32 tokens do not fit in ctx_size 32 (at most 31)"),
    ("Session.sync", lambda c: c.s.sync([1, 2], progress=5), SessionError,
     "progress: expected a callable or None, got 5"),
    # Session.eval
    ("Session.eval", lambda c: c.s.eval(1.0), TokenRangeError,
     "token: expected an integer in [0, 1023], got 1.0"),
    ("Session.eval", lambda c: c.s.eval(True), TokenRangeError, "got True"),
    ("Session.eval", lambda c: c.s.eval(-1), TokenRangeError, "got -1"),
    ("Session.eval", lambda c: c.s.eval(V), TokenRangeError, "got 1024"),
    ("Session.eval", lambda c: c.s.eval(NAN), TokenRangeError, "got nan"),
    ("Session.eval", lambda c: c.s.eval("3"), TokenRangeError, "got '3'"),
    # Session.rewind
    ("Session.rewind", lambda c: c.s.rewind(NAN), SessionError,
     "rewind: pos: expected an integer in [0, 3], got nan"),
    ("Session.rewind", lambda c: c.s.rewind(-1), SessionError, "got -1"),
    ("Session.rewind", lambda c: c.s.rewind(4), SessionError, "got 4"),
    ("Session.rewind", lambda c: c.s.rewind(1.0), SessionError, "got 1.0"),
    ("Session.rewind", lambda c: c.s.rewind(None), SessionError, "got None"),
    # Session.common_prefix
    ("Session.common_prefix", lambda c: c.s.common_prefix(["a"]), TokenRangeError,
     "expected integer ids"),
    ("Session.common_prefix", lambda c: c.s.common_prefix([[1]]), SessionError, "1-D"),
    # Session.restore
    ("Session.restore", lambda c: c.s.restore("x"), SessionError,
     "restore: expected a Snapshot, got str"),
    ("Session.restore", lambda c: c.s.restore(c.eng.session(16).snapshot()), SessionError,
     "restore: snapshot ctx_size 16 != session ctx_size 32"),
    ("Session.restore", lambda c: c.s.restore(dataclasses.replace(
        c.s.snapshot(), cfg=dataclasses.replace(c.eng.cfg, n_swa=64))), SessionError,
     "the snapshot was taken on a model of another shape"),
    ("Session.restore", lambda c: c.s.restore(Snapshot([1], None, None, 32)), SessionError,
     "another shape"),
    ("Session.restore", lambda c: c.s.restore(c.other.snapshot()), SessionError,
     "restore: the snapshot was taken on model '"),
    # Session.save
    ("Session.save", lambda c: c.s.save(c.d), SessionError, "cannot write it (Is a directory)"),
    ("Session.save", lambda c: c.s.save("/nonexistent/dir/s.npz"), SessionError,
     "cannot write it (No such file or directory)"),
    ("Session.save", lambda c: c.s.save(5), SessionError,
     "save: path: expected a file path (str or os.PathLike), got 5"),
    ("Session.save", lambda c: c.s.save(""), SessionError, "got ''"),
    # Session.load
    ("Session.load", lambda c: c.s.load(c.d), SessionError, "not a ds4ref session file"),
    ("Session.load", lambda c: c.s.load("/nonexistent.npz"), SessionError,
     "not a ds4ref session file"),
    ("Session.load", lambda c: c.s.load(c.d / "junk.npz"), SessionError,
     "not a ds4ref session file"),
    ("Session.load", lambda c: c.s.load(5), SessionError, "load: path: expected a file path"),
    ("Session.load", lambda c: c.s.load(c.d / "s16.npz"), SessionError,
     "ctx_size is 16, this session needs 32"),
    ("Session.load", lambda c: c.s.load(_forged(c, _set("format", "ds4ref-session-1"))),
     SessionError, "format 'ds4ref-session-1', this ds4ref reads 'ds4ref-session-3'"),
    ("Session.load", lambda c: c.s.load(_forged(c, _set("n_vocab", 99))), SessionError,
     "n_vocab is 99, this session needs 1024"),
    ("Session.load", lambda c: c.s.load(_forged(c, _set("tokens", np.array([1, V])))),
     SessionError, "tokens: 2 ids, expected fewer than 32 in [0, 1024)"),
    ("Session.load", lambda c: c.s.load(_forged(c, _set("tokens", np.array([1.0])))),
     SessionError, "tokens: expected a 1-D int64 array"),
    ("Session.load", lambda c: c.s.load(_forged(c, _set("logits", np.zeros(5, np.float32)))),
     SessionError, "logits: expected float32 (1024,)"),
    ("Session.load", lambda c: c.s.load(_forged(c, _set("cache.2.comp",
                                                         np.zeros((1, 256), np.float32)))),
     SessionError, "cache.2.comp: expected float32 (0, 256)"),
    ("Session.load", lambda c: c.s.load(_forged(c, _drop("cache.0.raw"))), SessionError,
     "cache.0.raw: expected float32 (3, 256)"),
    ("Session.load", lambda c: c.s.load(_forged(c, _add("cache.0.extra"))), SessionError,
     "arrays this format does not have: ['cache.0.extra']"),
    ("Session.load", lambda c: c.s.load(c.d / "other_model.npz"), SessionError,
     "model_digest is '"),
    ("Session.load", lambda c: c.s.load(_forged(c, _set("logits", np.full(V, NAN, np.float32)))),
     SessionError, "logits: hold NaN or inf, expected finite values"),
    ("Session.load", lambda c: c.s.load(_forged(c, _set("cache.0.raw", np.full(
        (3, 256), np.inf, np.float32)))), SessionError, "cache.0.raw: holds NaN or inf"),
    # Session.sample, top_logprobs and the other readers of the logits
    ("Session.sample", lambda c: c.s.sample(-1.0, rng=SampleRNG(1)), SamplingError,
     "temperature (0 = greedy): expected a finite number in [0, 100], got -1.0"),
    ("Session.sample", lambda c: c.s.sample(NAN, rng=SampleRNG(1)), SamplingError, "got nan"),
    ("Session.sample", lambda c: c.s.sample("1", rng=SampleRNG(1)), SamplingError, "got '1'"),
    ("Session.sample", lambda c: c.s.sample(1.0, top_k=-1, rng=SampleRNG(1)), SamplingError,
     "top_k (0 = off): expected an integer >= 0, got -1"),
    ("Session.sample", lambda c: c.s.sample(1.0, top_k=2.5, rng=SampleRNG(1)), SamplingError,
     "got 2.5"),
    ("Session.sample", lambda c: c.s.sample(1.0, top_k=None, rng=SampleRNG(1)), SamplingError,
     "got None"),
    ("Session.sample", lambda c: c.s.sample(1.0, top_p=0.0, rng=SampleRNG(1)), SamplingError,
     "top_p: must be in (0, 1], got 0.0"),
    ("Session.sample", lambda c: c.s.sample(1.0, top_p=1.5, rng=SampleRNG(1)), SamplingError,
     "top_p: expected a finite number in [0, 1], got 1.5"),
    ("Session.sample", lambda c: c.s.sample(1.0, min_p=2, rng=SampleRNG(1)), SamplingError,
     "min_p: expected a finite number in [0, 1], got 2"),
    ("Session.sample", lambda c: c.s.sample(1.0, rng="x"), SamplingError,
     "rng: a SampleRNG is needed when temperature > 0, got 'x'"),
    ("Session.sample", lambda c: c.s.sample(1.0), SamplingError, "got None"),
    ("SampleRNG", lambda c: SampleRNG(2**64), SamplingError,
     "seed: expected an integer in [0, 18446744073709551615], got 18446744073709551616"),
    ("SampleRNG", lambda c: SampleRNG(-1), SamplingError, "got -1"),
    ("SampleRNG", lambda c: SampleRNG(1.5), SamplingError, "got 1.5"),
    ("SampleRNG", lambda c: SampleRNG(True), SamplingError, "got True"),
    ("sample", lambda c: sample(np.zeros((2, 3), np.float32), 0.0), SamplingError,
     "logits: expected a non-empty 1-D vector, got shape (2, 3)"),
    ("sample", lambda c: sample(["a"], 0.0), SamplingError, "logits: not a vector of numbers"),
    ("Session.top_logprobs", lambda c: c.s.top_logprobs(0), SessionError,
     "top_logprobs: k: expected an integer >= 1, got 0"),
    ("Session.top_logprobs", lambda c: c.s.top_logprobs(NAN), SessionError, "got nan"),
    ("Session.top_logprobs", lambda c: c.s.top_logprobs(2.5), SessionError, "got 2.5"),
    ("Session.top_logprobs", lambda c: c.s.top_logprobs("3"), SessionError, "got '3'"),
    ("Session.argmax_excluding", lambda c: c.s.argmax_excluding(NAN), SamplingError,
     "excluded_id: expected an integer, got nan"),
    ("Session.token_logprob", lambda c: c.s.token_logprob(V), SamplingError,
     "token: expected an integer in [0, 1023], got 1024"),
    ("Session.token_logprob", lambda c: c.s.token_logprob(NAN), SamplingError, "got nan"),
    ("argmax_excluding", lambda c: argmax_excluding([], 1), SamplingError, "non-empty"),
    ("token_logprob", lambda c: token_logprob(np.zeros(4), 1.5), SamplingError, "got 1.5"),
    # MTP's speculative decoding
    ("Session.eval_speculative_argmax", lambda c: c.s.eval_speculative_argmax(1, 0),
     SessionError, "max_tokens: expected an integer >= 1, got 0"),
    ("Session.eval_speculative_argmax", lambda c: c.s.eval_speculative_argmax(1, NAN),
     SessionError, "got nan"),
    ("Session.eval_speculative_argmax", lambda c: c.s.eval_speculative_argmax(NAN, 2),
     TokenRangeError, "first_token: expected an integer in [0, 1023], got nan"),
    ("Session.eval_speculative_argmax", lambda c: c.s.eval_speculative_argmax(1, 2, "x"),
     TokenRangeError, "eos_token: expected an integer in [0, 1023], got 'x'"),
    # the tokenizer
    ("Tokenizer.encode", lambda c: c.tok.encode(5), TokenizerError,
     "text: expected a str, got int"),
    ("Tokenizer.encode", lambda c: c.tok.encode(b"hi"), TokenizerError, "got bytes"),
    ("Tokenizer.encode", lambda c: c.tok.encode("a\udcffb"), TokenizerError,
     "text: not encodable as UTF-8 (surrogates not allowed at character 1)"),
    ("Tokenizer.encode_rendered_chat", lambda c: c.tok.encode_rendered_chat(None),
     TokenizerError, "got NoneType"),
    ("Tokenizer.chat_prompt", lambda c: c.tok.chat_prompt(5), TokenizerError,
     "prompt: expected a str, got int"),
    ("Tokenizer.chat_prompt", lambda c: c.tok.chat_prompt("hi", system=5), TokenizerError,
     "system: expected a str, got int"),
    ("Tokenizer.chat_prompt", lambda c: c.tok.chat_prompt("hi", think="ultra"),
     TokenizerError, "think: expected one of"),
    ("Tokenizer.token_bytes", lambda c: c.tok.token_bytes(-1), TokenizerError,
     "token id: expected an integer in [0, 1023], got -1"),
    ("Tokenizer.token_bytes", lambda c: c.tok.token_bytes(1.5), TokenizerError, "got 1.5"),
    ("Tokenizer.decode", lambda c: c.tok.decode([1, "a"]), TokenizerError, "got 'a'"),
    ("Tokenizer.stream_decoder", lambda c: c.tok.stream_decoder()(NAN), TokenizerError,
     "got nan"),
    ("think_mode_for_context", lambda c: think_mode_for_context("max", 1.5), TokenizerError,
     "ctx_size: expected an integer, got 1.5"),
]


@pytest.mark.parametrize("entry, call, error, fragment", DOORS,
                         ids=[f"{i}-{row[0]}" for i, row in enumerate(DOORS)])
def test_every_door_refuses_with_a_named_error(door, entry, call, error, fragment):
    """The named class (a DS4RefError keeping its builtin base), a message that says what
    was given and what is allowed, and a session that is exactly as it was."""
    s, before = door.s, (door.s.tokens, door.s.logits.copy())
    with pytest.raises(error) as info:
        call(door)
    assert isinstance(info.value, DS4RefError) and fragment in str(info.value), str(info.value)
    assert s.tokens == before[0] and np.array_equal(s.logits, before[1])


def test_a_session_of_another_model_is_refused_naming_both(door):
    """A file or snapshot from a model of the same shape but other weights is refused,
    naming both digests; the same model opened again has the same digest and loads."""
    mine, theirs = door.eng.model_digest, door.other.engine.model_digest
    assert door.other.cfg == door.eng.cfg and mine != theirs
    assert re.fullmatch("[0-9a-f]{16}", mine) and re.fullmatch("[0-9a-f]{16}", theirs)
    with pytest.raises(SessionError) as info:
        door.s.load(door.d / "other_model.npz")
    assert f"model_digest is {theirs!r}, this session needs {mine!r}" in str(info.value)
    with pytest.raises(SessionError) as info:
        door.s.restore(door.other.snapshot())
    assert f"on model {theirs!r}, this session runs model {mine!r}" in str(info.value)
    again = Engine.open(backend="numpy").session(32)
    assert again.engine.model_digest == mine
    again.load(door.d / "s32.npz")
    assert again.tokens == door.s.tokens and np.array_equal(again.logits, door.s.logits)


@pytest.mark.parametrize("path", ["/dev/zero", "/dev/urandom", "text.txt", "junk.npz"])
def test_load_of_a_foreign_file_says_so_plainly(door, path):
    """Not numpy's reason (which speaks of pickles): the plain statement, nothing after."""
    path = door.d / path if not path.startswith("/") else path
    with pytest.raises(SessionError) as info:
        door.s.load(path)
    assert str(info.value) == f"load {path}: not a ds4ref session file"


def test_documented_edges_of_the_doors(door):
    """What is accepted at the edges, as documented: top_k above 1024 keeps 1024 (ds4.c's
    candidate buffer), an excluded id outside the vocabulary excludes nothing, top_logprobs
    returns at most n_vocab entries, the largest 64-bit seed is taken as it is."""
    s, lg = door.s, door.s.logits
    assert (sample(lg, 1.0, top_k=5000, rng=SampleRNG(3))
            == sample(lg, 1.0, top_k=1024, rng=SampleRNG(3)))
    assert s.argmax_excluding(-7) == s.argmax_excluding(V) == s.argmax()
    assert len(s.top_logprobs(10**6)) == V
    assert SampleRNG(2**64 - 1).state == 2**64 - 1
    assert s.rewind(s.pos) is None and s.tokens == [1, 2, 3]
    assert s.common_prefix([]) == 0 and s.common_prefix(np.array([1, 2, 9])) == 2


CLI = [
    (["--summary", "-m", "/nonexistent/x.gguf"], "cannot open: No such file or directory"),
    (["-n", "x"], "argument -n/--tokens: invalid int value: 'x'"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--think", "ultra"], "argument --think: invalid choice: 'ultra'"),
    (["-n", "-1"], "argument -n/--tokens: must be >= 0, got -1"),
    (["-c", "0", "-n", "1"], "ctx_size: expected an integer >= 2, got 0"),
    (["-c", "8", "-p", "hello there", "-n", "1", "--no-progress"], "do not fit in ctx_size 8"),
    (["--temp", "nan", "-n", "1"], "temperature (0 = greedy): expected a finite number"),
    (["--temp", "1e308", "-n", "1"], "temperature (0 = greedy): expected a finite number "
                                     "in [0, 100], got 1e+308"),
    (["--top-p", "0", "-n", "1"], "top_p: must be in (0, 1], got 0.0"),
    (["--top-k", "-1", "-n", "1"], "top_k (0 = off): expected an integer >= 0, got -1"),
    (["--min-p", "2", "-n", "1"], "min_p: expected a finite number in [0, 1], got 2.0"),
    (["--seed", "-1", "-n", "1", "--no-progress"], "seed: expected an integer in [0, "),
    (["--seed", str(2**64), "-n", "1", "--no-progress"], "got 18446744073709551616"),
    (["--mtp-draft", "0", "-n", "1"], "mtp_draft_tokens: expected an integer in [1, 16]"),
    (["--mtp-margin", "-1", "-n", "1"], "mtp_margin: expected a finite number in [0, 1000]"),
    (["--backend", "nosuch", "-n", "1"],
     "error: backend 'nosuch': unknown; choose one of numpy, numba, mlx, cupy or 'auto'"),
    (["--resident", "--backend", "numpy", "-n", "1"], "computes on host arrays"),
    (["--dir-steering-attn", "0.5", "-n", "1"], "directional steering needs steering_file"),
    (["--dir-steering-file", "/nonexistent", "-n", "1"], "steering file /nonexistent"),
    (["--dir-steering-ffn", "inf", "-n", "1"], "steering_ffn: expected a finite number"),
    (["-p", "a\udcffb", "-n", "1", "--no-progress"], "prompt: not encodable as UTF-8"),
    (["-m", "/"], "cannot open: Is a directory"),
    (["--summary", "-m", ""], "path: expected a file path (str or os.PathLike), got ''"),
]


@pytest.mark.parametrize("argv, fragment", CLI, ids=[" ".join(a)[:40] for a, _ in CLI])
def test_cli_prints_one_line_and_exits_2(argv, fragment, capsys):
    if "--backend" not in argv:          # numpy: no backend line, no kernels to prepare
        argv = ["--backend", "numpy", *argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().split("\n")
    assert len(err) == 1 and err[0].startswith("python -m ds4ref: error: "), err
    assert fragment in err[0], err[0]


def test_cli_as_a_program_prints_no_traceback():
    """The issue's example, run as a real process: one line on stderr, exit status 2."""
    r = subprocess.run([sys.executable, "-m", "ds4ref", "--summary", "-m", "/nonexistent/x.gguf"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert re.fullmatch(r"python -m ds4ref: error: /nonexistent/x\.gguf: cannot open: No such "
                        r"file or directory\n", r.stderr), r.stderr


# greedy from "x" on the bundled model runs to -n without an EOS, printing as it goes
LONG_RUN = [sys.executable, "-m", "ds4ref", "--backend", "numpy", "--raw", "-p", "x",
            "--temp", "0", "-n", "1000", "--no-progress"]


def test_cli_ends_quietly_when_its_reader_leaves(tmp_path):
    """`| head -c1`: the reader closes the pipe after the first byte; the CLI stops with 141
    (128 + SIGPIPE, what the shell reports for ds4.c) and no traceback."""
    with open(tmp_path / "err", "w") as err:
        p = subprocess.Popen(LONG_RUN, stdout=subprocess.PIPE, stderr=err)
        assert p.stdout.read(1)
        p.stdout.close()
        assert p.wait(timeout=300) == 141
    assert (tmp_path / "err").read_text() == ""


def test_cli_stops_on_ctrl_c_with_one_line_and_130():
    """SIGINT after the first output: one line `interrupted` on stderr, status 130."""
    p = subprocess.Popen(LONG_RUN, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert p.stdout.read(1)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 130 and err.decode() == "python -m ds4ref: interrupted\n", err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="/dev/full is a Linux device")
def test_cli_says_when_it_cannot_write_its_output():
    """stdout on a full device, or closed (`>&-`): one line, status 2; stderr closed
    (`2>&-`): the text is still generated, status 0."""
    run = [*LONG_RUN[:-3], "-n", "4", "--no-progress"]
    with open("/dev/full", "w") as full:
        r = subprocess.run(run, stdout=full, stderr=subprocess.PIPE, text=True, timeout=300)
    assert (r.returncode, r.stderr) == (2, "python -m ds4ref: error: cannot write output: "
                                           "No space left on device\n")
    r = subprocess.run(run, stderr=subprocess.PIPE, text=True, timeout=300,
                       preexec_fn=lambda: os.close(1))
    assert (r.returncode, r.stderr) == (2, "python -m ds4ref: error: cannot write output: "
                                           "standard output is closed\n")
    r = subprocess.run(run, stdout=subprocess.PIPE, text=True, timeout=300,
                       preexec_fn=lambda: os.close(2))
    assert r.returncode == 0 and len(r.stdout) > 1, r.stdout


def test_cli_error_is_a_named_error():
    assert issubclass(CLIError, DS4RefError) and issubclass(CLIError, ValueError)


def test_save_writes_only_the_rows_in_use_and_load_round_trips_bit_for_bit(tmp_path):
    """3 tokens at ctx 65,536: the file holds 3 raw rows per layer, no compressed row and
    the compressor states, under 1 MB (the whole cache is 53 MB); load gives back every
    cache array, count, token and logit bit for bit, and the next eval agrees."""
    eng = Engine.open(backend="numpy", mtp_draft_tokens=1)
    s = eng.session(65536)
    s.sync([1, 2, 3])
    s.save(tmp_path / "s.npz")
    size = (tmp_path / "s.npz").stat().st_size
    assert size < 1_000_000 < 50_000_000 < s._cache.nbytes
    with np.load(tmp_path / "s.npz") as z:
        assert z["cache.0.raw"].shape == (3, 256) and z["cache.2.comp"].shape == (0, 256)
        assert z["cache.2.index_comp"].shape == (0, 128)
    t = eng.session(65536)
    t.load(tmp_path / "s.npz")
    for a, b in zip(s._cache.layers, t._cache.layers):
        assert vars(a).keys() == vars(b).keys()
        for k, v in vars(a).items():
            w = getattr(b, k)
            if hasattr(v, "shape"):
                assert v.dtype == w.dtype and np.array_equal(v, w), k
            else:
                assert v == w, k
    assert t.tokens == s.tokens and np.array_equal(t.logits, s.logits)
    assert np.array_equal(t.eval(7), s.eval(7))


# ------------------------------------------------------------- session operations (Hypothesis)

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

CTX = 16
ids = st.integers(0, 1023)
OPS = st.lists(st.one_of(
    st.tuples(st.just("sync_extend"), st.lists(ids, min_size=1, max_size=3)),
    st.tuples(st.just("sync_edit"), st.tuples(st.integers(0, 5),
                                              st.lists(ids, min_size=1, max_size=3))),
    st.tuples(st.just("eval"), ids),
    st.tuples(st.just("rewind"), st.integers(0, 12)),
    st.tuples(st.just("snapshot"), st.none()),
    st.tuples(st.just("restore"), st.none()),
    st.tuples(st.just("save_load"), st.none()),
), min_size=1, max_size=6)


def _engine(oracle_gguf, name):
    from ds4ref.backends import get_backend
    be = "numpy" if name == "numpy" else get_backend(name, strict=True)
    return Engine.open(oracle_gguf, backend=be)


def _replay(eng, history):
    """A fresh session that runs the sync / eval / rewind calls of `history`: the path the
    live session's state took, without its snapshots, restores and files."""
    s = eng.session(CTX)
    for op, arg in history:
        getattr(s, op)(arg)
    return s


def _run_program(eng, program, tmp):
    """Run the program on one session; returns it and the history that rebuilds it. A
    refused operation must leave tokens and logits exactly as they were."""
    s, history, snap = eng.session(CTX), [], None
    for op, arg in program:
        before = (s.tokens, None if s.pos == 0 else s.logits.copy())
        try:
            if op == "sync_extend":
                s.sync(s.tokens + arg)
                history.append(("sync", s.tokens))
            elif op == "sync_edit":                     # keep a prefix, change the rest
                keep, tail = arg
                s.sync(s.tokens[:keep] + tail)
                history.append(("sync", s.tokens))
            elif op == "eval":
                s.eval(arg)
                history.append(("eval", arg))
            elif op == "rewind":
                s.rewind(min(arg, s.pos))
                history.append(("rewind", s.pos))
            elif op == "snapshot":
                snap = (s.snapshot(), list(history))
            elif op == "restore" and snap is not None:
                s.restore(snap[0])
                history = list(snap[1])
            elif op == "save_load":
                s.save(tmp / "s.npz")
                s = eng.session(CTX)
                s.load(tmp / "s.npz")
        except ContextOverflowError:
            assert s.tokens == before[0]
            assert before[1] is None or np.array_equal(s.logits, before[1])
    return s, history


def _check_program(eng, program, tmp, one_shot: bool):
    s, history = _run_program(eng, program, tmp)
    fresh = _replay(eng, history)
    assert fresh.tokens == s.tokens, program
    if s.pos == 0:
        return
    assert np.array_equal(fresh.logits, s.logits), program
    if one_shot:                                         # numpy: decode == prefill bit for bit
        p = eng.session(CTX)
        p.sync(s.tokens)
        assert np.array_equal(p.logits, s.logits), program
    if s.pos + 1 < CTX:                                  # the caches agree too
        assert np.array_equal(fresh.eval(5), s.eval(5)), program


@pytest.fixture(scope="module")
def numpy_engine(oracle_gguf):
    return _engine(oracle_gguf, "numpy")


@pytest.fixture(scope="module")
def numba_engine(oracle_gguf):
    pytest.importorskip("numba")
    return _engine(oracle_gguf, "numba")


@settings(max_examples=6, deadline=None, suppress_health_check=[
    HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(OPS)
def test_session_operations_equal_a_fresh_session_on_numpy(numpy_engine, tmp_path, program):
    """Any mix of sync (extending or editing), eval, rewind, snapshot / restore and save / load
    leaves exactly the state of a fresh session that ran only the sync / eval / rewind calls,
    and (numpy computes a prefill and decode steps with the same bits) of a one-shot prefill."""
    _check_program(numpy_engine, program, tmp_path, one_shot=True)


@settings(max_examples=6, deadline=None, suppress_health_check=[
    HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(OPS)
def test_session_operations_equal_the_same_path_on_numba(numba_engine, tmp_path, program):
    """On numba a prefill and decode steps round differently, so the reference is a fresh
    session that takes the same path (the same sync / eval / rewind calls): bit for bit."""
    _check_program(numba_engine, program, tmp_path, one_shot=False)

"""Chapter 10.5 (book/10_beyond.ipynb): generate and stream_generate, the CLI's stop reasons, and
what `import ds4ref` shows (dir, tab completion, help)."""
from __future__ import annotations

import contextlib
import io
import pydoc

import numpy as np
import pytest

import ds4ref
from ds4ref.bundled import default_model_path
from ds4ref.engine import Engine
from ds4ref.generation import (GenerationError, StopStrings, generate, prompt_tokens,
                               stream_generate)
from ds4ref.sample import SampleRNG, SamplingError


@pytest.fixture(scope="module")
def bundled():
    """The bundled model with its MTP GGUF (Engine.open's default), on the numpy reference."""
    eng = Engine.open(backend="numpy")
    assert eng.has_mtp
    return eng


@pytest.fixture(scope="module")
def plain():
    """The same model without MTP drafts: one token per step."""
    eng = Engine.open(default_model_path(), backend="numpy")
    assert not eng.has_mtp
    return eng


def manual_decode(engine, ids, n, draw):
    """The loop written out: sync, then draw(session) and eval until EOS or n tokens."""
    s = engine.session()
    s.sync(ids)
    out = []
    while len(out) < n:
        t = draw(s)
        if t == engine.tokenizer.eos_id:
            break
        out.append(t)
        s.eval(t)
    return out


def tokens_of(steps, eos):
    return [r.token for r in steps if r.token is not None and r.token != eos]


# ---------------------------------------------------------------------------------- generation

def test_streamed_text_joins_to_the_generated_text(bundled):
    kw = dict(max_tokens=12, seed=3, temperature=0.9, top_k=40, top_p=0.95)
    steps = list(stream_generate("Tell me about the weather.", bundled, **kw))
    assert "".join(r.text for r in steps) == generate("Tell me about the weather.", bundled, **kw)
    assert all(r.finish_reason is None for r in steps[:-1]) and steps[-1].finish_reason


@pytest.mark.parametrize("prompt", ["Create a new", "Return the"])
def test_greedy_equals_the_argmax_decode(bundled, plain, prompt):
    """With MTP drafts (bundled) and without (plain): the tokens of a plain argmax loop, and
    the text is their decoding."""
    ids = prompt_tokens(bundled.tokenizer, prompt, raw=True)
    want = manual_decode(plain, ids, 20, lambda s: s.argmax())
    for eng in (bundled, plain):
        steps = list(stream_generate(prompt, eng, raw=True, temperature=0, max_tokens=20))
        assert tokens_of(steps, eng.tokenizer.eos_id) == want
        assert "".join(r.text for r in steps) == eng.tokenizer.decode(want)


def test_a_seed_reproduces_the_sampler_draws(plain):
    kw = dict(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05)
    ids = prompt_tokens(plain.tokenizer, "Open the file", raw=True)
    rng = SampleRNG(11)
    want = manual_decode(plain, ids, 16, lambda s: s.sample(rng=rng, **kw))
    runs = [tokens_of(stream_generate("Open the file", plain, raw=True, max_tokens=16, seed=11,
                                      **kw), plain.tokenizer.eos_id) for _ in range(2)]
    assert runs[0] == runs[1] == want


def test_stop_strings_end_the_text_before_them(plain):
    steps = list(stream_generate("Create a new", plain, raw=True, temperature=0, max_tokens=24))
    full = "".join(r.text for r in steps)
    pieces = [r.text for r in steps if r.text]
    assert len(pieces) > 4
    # a stop string inside one token, one across a token boundary, and two at once
    across = pieces[2][-1] + pieces[3][:2]
    for stop in (pieces[1], across, [pieces[3], pieces[2]]):
        first = min(full.find(s) for s in ([stop] if isinstance(stop, str) else stop))
        got = list(stream_generate("Create a new", plain, raw=True, temperature=0,
                                   max_tokens=24, stop=stop))
        assert "".join(r.text for r in got) == full[:first]
        assert got[-1].finish_reason == "stop" and len(got) < len(steps)
    # a stop string that never comes changes nothing
    never = list(stream_generate("Create a new", plain, raw=True, temperature=0, max_tokens=24,
                                 stop="\x00never"))
    assert [r.text for r in never] == [r.text for r in steps]


def test_streaming_holds_back_only_a_possible_start_of_a_stop_string():
    st = StopStrings(["abc", "zz"])
    assert st.feed("xab") == ("x", False)        # "ab" may begin "abc"
    assert st.feed("d") == ("abd", False)        # it did not
    assert st.feed("qz") == ("q", False)
    assert st.feed("ab") == ("z", False) and st.pending == "ab"
    assert st.feed("c tail") == ("", True)       # the stop string and what follows are dropped
    assert StopStrings().feed("abc") == ("abc", False)
    assert StopStrings("b").feed("abc") == ("a", True)


def test_finish_reasons(bundled, monkeypatch):
    ids = prompt_tokens(bundled.tokenizer, "Create a new", raw=True)
    steps = list(stream_generate(ids, bundled, temperature=0, max_tokens=3))
    assert [r.finish_reason for r in steps] == [None, None, "length"]
    # a context of len(prompt) + 3 positions leaves 2 tokens (the last position stays free)
    steps = list(stream_generate(ids, bundled, temperature=0, max_tokens=50,
                                 ctx_size=len(ids) + 3))
    assert len(steps) == 2 and steps[-1].finish_reason == "context"
    steps = list(stream_generate(ids, bundled, temperature=0, max_tokens=0))
    assert [(r.text, r.token, r.finish_reason) for r in steps] == [("", None, "length")]
    # EOS: the model's first greedy token, declared the end of sequence
    eng = Engine.open(default_model_path(), backend="numpy")
    s = eng.session()
    s.sync(ids)
    monkeypatch.setattr(eng.tokenizer, "eos_id", s.argmax())
    steps = list(stream_generate(ids, eng, temperature=0))
    assert [(r.text, r.token, r.finish_reason) for r in steps] == [("", s.argmax(), "eos")]


def test_prompt_tokens_use_ds4_chat_template_unless_raw(bundled):
    tok = bundled.tokenizer
    assert prompt_tokens(tok, "Return a", raw=True) == [tok.bos_id] + tok.encode("Return a")
    assert prompt_tokens(tok, "Hi", system="Be brief", think="none") == tok.chat_prompt(
        "Hi", "Be brief", "none")
    # think "max" needs a context of 393216 tokens; below it ds4 runs "high"
    assert prompt_tokens(tok, "Hi", system="Be brief", think="max", ctx_size=1024) == tok.chat_prompt(
        "Hi", "Be brief", "high")
    assert prompt_tokens(tok, "Hi", think="max", ctx_size=393216) == tok.chat_prompt(
        "Hi", None, "max")
    assert prompt_tokens(tok, np.array([0, 5, 7])) == [0, 5, 7]


def test_the_default_model_is_the_bundled_one():
    from ds4ref.generation import _engine
    eng = _engine(None, "numpy")
    assert eng.path == default_model_path() and eng.has_mtp
    assert _engine(None, "numpy") is eng                       # opened once
    assert generate("Return a", backend="numpy", raw=True, temperature=0, max_tokens=4) == \
        generate("Return a", eng, raw=True, temperature=0, max_tokens=4)


def test_a_model_replaced_at_its_path_is_reopened(plain, tmp_path):
    """generate keeps the last engine it opened, keyed on the file's identity too: a new
    file moved over the path (os.replace, as the GGUF writer does) is the new model."""
    import os
    import shutil
    other = ds4ref.data_path("oracle", "dev_seed1.gguf")
    path = tmp_path / "m.gguf"
    shutil.copy(default_model_path(), path)
    kw = dict(max_tokens=4, temperature=0, backend="numpy")
    old = generate([0, 1, 2], path, **kw)
    assert old == generate([0, 1, 2], plain, **kw)     # an Engine: the cache is kept
    shutil.copy(other, tmp_path / "new.gguf")
    os.replace(tmp_path / "new.gguf", path)
    new = generate([0, 1, 2], Engine.open(other, backend="numpy"), **kw)
    assert new != old
    assert generate([0, 1, 2], path, **kw) == new


@pytest.mark.parametrize("prompt, dtype", [
    ([1.9, 2.9], "float64"), (np.array([1.7, 2.2]), "float64"), (["5"], "<U1"),
    (["a"], "<U1"), ([True, False], "bool"), ([np.float32(3.0)], "float32"),
])
def test_token_prompts_must_be_integer_ids(bundled, prompt, dtype):
    """The ids are checked as Session.sync checks them, never truncated by int()."""
    from ds4ref.session import TokenRangeError
    with pytest.raises(TokenRangeError, match=f"expected integer ids, got dtype {dtype}"):
        generate(prompt, bundled, max_tokens=1)


@pytest.mark.parametrize("prompt, kind", [
    (b"Return a", "bytes"), (bytearray(b"Re"), "bytearray"), ({1: 2}, "dict"),
    (None, "NoneType"), (5, "int"), ({1, 2}, "set"),
])
def test_a_prompt_is_a_str_or_a_sequence_of_ids(bundled, prompt, kind):
    with pytest.raises(GenerationError, match="prompt: expected a str or a sequence of "
                       f"integer token ids, got {kind}$"):
        generate(prompt, bundled, max_tokens=1)


def test_bad_arguments_raise_named_errors(bundled, tmp_path):
    from ds4ref.gguf import DS4RefError, GGUFError
    from ds4ref.session import SessionError, TokenRangeError
    cases = [
        (dict(max_tokens=-1), GenerationError, "max_tokens: expected an integer >= 0"),
        (dict(max_tokens=2.5), GenerationError, "max_tokens"),
        (dict(max_tokens=True), GenerationError, "max_tokens"),
        # a float is refused whatever its value, before anything runs
        (dict(max_tokens=2.0, temperature=0), GenerationError, "max_tokens: .* got 2.0"),
        (dict(max_tokens=float("nan")), GenerationError, "max_tokens: .* got nan"),
        (dict(max_tokens=float("inf")), GenerationError, "max_tokens: .* got inf"),
        (dict(max_tokens="abc"), GenerationError, "max_tokens: .* got 'abc'"),
        (dict(max_tokens=None), GenerationError, "max_tokens: .* got None"),
        (dict(max_tokens=[1]), GenerationError, r"max_tokens: .* got \[1\]"),
        (dict(max_tokens=1 + 0j), GenerationError, r"max_tokens: .* got \(1\+0j\)"),
        (dict(raw="no"), GenerationError, "raw: expected True or False, got 'no'"),
        (dict(raw=None), GenerationError, "raw: expected True or False, got None"),
        (dict(raw=0), GenerationError, "raw: expected True or False, got 0"),
        (dict(raw=[]), GenerationError, r"raw: expected True or False, got \[\]"),
        (dict(stop=5), GenerationError, "stop: expected a str or a list of str, got 5"),
        (dict(stop=0), GenerationError, "stop: expected a str or a list of str, got 0"),
        # ds4's --temp range: a float32 temperature cannot overflow
        (dict(temperature=1e308), SamplingError, r"temperature \(0 = greedy\): expected a "
                                                 r"finite number in \[0, 100\], got 1e\+308"),
        (dict(temperature=100.5), SamplingError, "temperature .* got 100.5"),
        (dict(stop=[""]), GenerationError, "stop: expected non-empty strings"),
        (dict(stop=["ok", 3]), GenerationError, "stop: expected non-empty strings"),
        (dict(temperature=-1.0), SamplingError, "temperature"),
        (dict(top_p=0.0), SamplingError, "top_p"),
        (dict(seed="seven"), SamplingError, "seed"),
    ]
    for kw, err, msg in cases:
        with pytest.raises(err, match=msg):
            generate("Hi", bundled, **kw)
        assert issubclass(err, DS4RefError)
    with pytest.raises(TokenRangeError):
        generate([0, 10**6], bundled)
    with pytest.raises(SessionError, match=r"expected a 1-D sequence of ids, got shape"):
        generate([[1, 2]], bundled)
    ids = prompt_tokens(bundled.tokenizer, "Return a", raw=True)
    assert generate(ids, bundled, temperature=0, max_tokens=np.int64(3)) == generate(
        ids, bundled, temperature=0, max_tokens=3)
    with pytest.raises(GGUFError):
        generate("Hi", tmp_path / "missing.gguf", backend="numpy")


def test_tiny_temperatures_run_as_ds4c_without_warnings(bundled):
    """1e-50 is 0 in float32, greedy as in ds4.c; for 1e-45 (float32's least) every
    token but the best has (v - max) / T = -inf, weight 0: the greedy token, drawn."""
    import warnings
    greedy = generate("Return a", bundled, raw=True, temperature=0, max_tokens=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for t in (1e-50, 1e-45):
            assert generate("Return a", bundled, raw=True, temperature=t, max_tokens=4,
                            seed=1) == greedy


# --------------------------------------------------------------------------- what the package shows

def test_the_package_lists_its_public_names():
    names = dir(ds4ref)
    for name in ("Engine", "Session", "Tokenizer", "SampleRNG", "generate", "stream_generate",
                 "data_path", "GGUFFile", "load_model"):
        assert name in names and name in ds4ref.__all__
    for name in ds4ref.__all__:
        assert getattr(ds4ref, name) is not None, name
    assert ds4ref.generate is generate and ds4ref.stream_generate is stream_generate


def test_help_starts_with_the_module_docstring():
    synopsis = pydoc.splitdoc(ds4ref.__doc__)[0]
    assert synopsis.startswith("ds4.c, antirez") and "AUTOGENERATED" not in ds4ref.__doc__
    text = pydoc.render_doc(ds4ref, renderer=pydoc.plaintext)
    assert "NAME\n    ds4ref - ds4.c, antirez" in text
    for section, name in (("CLASSES", "class Engine"), ("FUNCTIONS", "generate("),
                          ("FUNCTIONS", "stream_generate(")):
        assert name in text.split(section, 1)[1], (section, name)


# ----------------------------------------------------------------------------------------- CLI

def run_cli(*argv):
    from ds4ref.__main__ import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["--backend", "numpy", "--no-progress", "--raw", *argv])
    return rc, out.getvalue(), err.getvalue().splitlines()


def test_cli_says_why_it_stopped(bundled):
    rc, out, err = run_cli("-p", "Create a new", "-n", "3", "--temp", "0")
    assert rc == 0 and err[-1].startswith("decode: 3 tokens in ") and "stopped at -n 3" in err[-1]
    assert out == generate("Create a new", bundled, raw=True, temperature=0, max_tokens=3) + "\n"
    # a context of len(prompt) + 2 positions leaves 1 token (the last position stays free)
    n = len(prompt_tokens(bundled.tokenizer, "Create a new", raw=True)) + 2
    rc, out, err = run_cli("-p", "Create a new", "-n", "9", "--temp", "0", "-c", str(n))
    assert err[-1].startswith("decode: 1 token in ")
    assert f"stopped at the context's end (--ctx {n})" in err[-1]
    rc, out, err = run_cli("-p", "Raise ValueError if", "-n", "30", "--temp", "0", "--stop", " is")
    want = generate("Raise ValueError if", bundled, raw=True, temperature=0, stop=" is")
    assert out == want + "\n" and "stopped at a --stop string" in err[-1]


def test_cli_takes_a_tiny_temperature_as_ds4c_does(bundled, monkeypatch):
    """ds4.c keeps --temp in a float, so 1e-50 is 0: greedy, speculative with MTP drafts
    (its `temperature <= 0.0f` test, ds4_cli.c l. 515), and no seed to report."""
    from ds4ref.session import Session
    calls = []
    real = Session.eval_speculative_argmax

    def counted(self, *a, **kw):
        calls.append(a)
        return real(self, *a, **kw)
    monkeypatch.setattr(Session, "eval_speculative_argmax", counted)
    greedy = run_cli("-p", "Return a", "-n", "6", "--temp", "0", "--mtp-draft", "2")
    n_greedy, calls[:] = len(calls), []
    tiny = run_cli("-p", "Return a", "-n", "6", "--temp", "1e-50", "--mtp-draft", "2")
    assert tiny[0] == 0 and tiny[1] == greedy[1]
    assert len(calls) == n_greedy > 0
    assert "seed=" not in tiny[2][-1] and "seed=" in run_cli(
        "-p", "Return a", "-n", "2", "--temp", "1e-45")[2][-1]


def test_cli_reports_eos(bundled, monkeypatch):
    from ds4ref import engine as engine_mod
    ids = prompt_tokens(bundled.tokenizer, "Return a", raw=True)
    s = bundled.session()
    s.sync(ids)
    first = s.argmax()
    opened = engine_mod.Engine.open

    def open_with_eos(*a, **kw):                 # the first greedy token declared EOS
        eng = opened(*a, **kw)
        eng.tokenizer.eos_id = first
        return eng

    monkeypatch.setattr(engine_mod.Engine, "open", open_with_eos)
    rc, out, err = run_cli("-p", "Return a", "-n", "8", "--temp", "0")
    assert rc == 0 and out == "\n" and "stopped at EOS" in err[-1]


def test_cli_prints_no_rate_for_one_token_and_no_seed_when_greedy():
    rc, out, err = run_cli("-p", "Return a", "-n", "1", "--temp", "0")
    assert rc == 0 and err[-1].startswith("decode: 1 token in ")
    assert "tok/s" not in err[-1] and "seed=" not in err[-1]
    rc, out, err = run_cli("-p", "Return a", "-n", "3", "--temp", "1", "--seed", "5")
    assert "tok/s" in err[-1] and err[-1].endswith("seed=5")


def test_cli_refuses_an_empty_stop_string():
    rc, out, err = run_cli("-p", "Hi", "--stop", "")
    assert rc == 2 and err == ["python -m ds4ref: error: stop: expected non-empty strings, got ['']"]

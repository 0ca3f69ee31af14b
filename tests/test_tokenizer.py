"""Byte-level BPE with ds4.c's pre-tokenizer, cross-checked against the `tokenizers` package."""
from __future__ import annotations

import json
import random
import subprocess
import sys
import unicodedata
from pathlib import Path

import gguf
import pytest
from tokenizers import Regex
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from ds4ref.gguf import GGUFFile
from ds4ref.tokenizer import (BYTE_TO_CHAR, CHAR_TO_BYTE, REASONING_EFFORT_MAX_PREFIX, SPECIAL_TOKENS,
                              Tokenizer, TokenizerError, pretokenize)

# Varied text (Chinese, full-width punctuation, emoji, code, whitespace runs, digits, accents, specials, the
# empty string): the texts that tools/ds4c/record.py also ran through ds4.c's own tokenizer, read from there so
# there is one list.
TEXTS = json.loads((Path(__file__).resolve().parents[1] / "data/oracle/ds4c_tokenizer.json").read_text())["texts"]

JOYAI_REGEX = (r"\p{N}{1,3}|[一-龥぀-ゟ゠-ヿ]+|[\p{P}\p{S}][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
               r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _hf(tokens: list[str], merges: list[str]) -> HFTokenizer:
    """The `tokenizers` byte-level BPE built from the same vocab and merges (no regex split)."""
    t = HFTokenizer(models.BPE(vocab={s: i for i, s in enumerate(tokens)},
                               merges=[tuple(m.split(" ")) for m in merges]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    t.decoder = decoders.ByteLevel()
    return t


def _hf_ids(hf: HFTokenizer, text: str) -> list[int]:
    pieces = [p.decode("utf-8") for p in pretokenize(text)]
    return hf.encode(pieces, is_pretokenized=True).ids if pieces else []


@pytest.fixture(scope="module")
def oracle_vocab(oracle_gguf):
    g = GGUFFile(oracle_gguf)
    return list(g.metadata["tokenizer.ggml.tokens"]), list(g.metadata["tokenizer.ggml.merges"])


@pytest.fixture(scope="module")
def trained_vocab():
    """A richer vocab: 3000-symbol byte-level BPE trained by `tokenizers` on varied text."""
    corpus = [t * 3 for t in TEXTS if t] + [
        "The quick brown fox jumps over the lazy dog. " * 5,
        "for (int i = 0; i < n; i++) { sum += a[i] * b[i]; }\n" * 5,
        "我们在这里测试中文的分词效果，以及与英文混合的情况。" * 5,
        "import numpy as np\nx = np.arange(10)\nprint(x.sum())\n" * 5,
        "ひらがなとカタカナのテスト。" * 5, "1234567890 9876543210 " * 5, "🙂🙃😉😊 " * 5,
    ]
    rnd = random.Random(0)
    alphabets = ["abcdefghijklmnopqrstuvwxyz", "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年",
                 "αβγδεζηθικλμνξοπρστυφχψω", "(){}[];:.,+-*/=<>!?"]
    for _ in range(3000):
        a = rnd.choice(alphabets)
        corpus.append(" ".join("".join(rnd.choice(a[:rnd.randint(3, len(a))]) for _ in range(rnd.randint(1, 6)))
                               for _ in range(rnd.randint(1, 8))))
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tr = trainers.BpeTrainer(vocab_size=3000, min_frequency=1, show_progress=False,
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                             special_tokens=list(SPECIAL_TOKENS.values()))
    hf.train_from_iterator(corpus, trainer=tr)
    model = json.loads(hf.to_str())["model"]
    vocab = model["vocab"]
    tokens = [None] * len(vocab)
    for s, i in vocab.items():
        tokens[i] = s
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    assert len(merges) > 1000
    return tokens, merges


def test_vocab_matches_gguf_package(oracle_gguf, oracle_vocab):
    r = gguf.GGUFReader(str(oracle_gguf))
    f = r.fields["tokenizer.ggml.tokens"]
    assert oracle_vocab[0] == [bytes(f.parts[i]).decode() for i in f.data]
    f = r.fields["tokenizer.ggml.merges"]
    assert oracle_vocab[1] == [bytes(f.parts[i]).decode() for i in f.data]
    assert len(oracle_vocab[1]) == 761


def test_special_ids_of_oracle_vocab(oracle_vocab):
    tk = Tokenizer(*oracle_vocab)
    assert (tk.bos_id, tk.eos_id, tk.user_id, tk.assistant_id) == (0, 1, 258, 259)
    assert (tk.think_start_id, tk.think_end_id, tk.dsml_id) == (260, 261, 262)


@pytest.mark.parametrize("which", ["oracle", "trained"])
def test_bpe_equals_tokenizers_package(which, oracle_vocab, trained_vocab):
    tokens, merges = oracle_vocab if which == "oracle" else trained_vocab
    tk, hf = Tokenizer(tokens, merges), _hf(tokens, merges)
    n_multi = 0
    for text in TEXTS:
        ids = tk.encode(text)
        assert ids == _hf_ids(hf, text), text
        assert tk.decode(ids) == text
        n_multi += sum(len(tk.tokens[i]) > 1 for i in ids)
    assert n_multi > 20          # the merges really fire


def test_pretokenizer_equals_joyai_regex():
    """ds4.c's hand-written split agrees with the JoyAI regex its comment states, on all test texts."""
    split = pre_tokenizers.Split(Regex(JOYAI_REGEX), behavior="isolated")
    for text in TEXTS:
        ours = [p.decode("utf-8") for p in pretokenize(text)]
        if any(ord(c) > 127 and not unicodedata.category(c).startswith("L") for c in text):
            continue     # non-ASCII punctuation, symbols, spaces: see the test below
        assert ours == [p for p, _ in split.pre_tokenize_str(text)], text


def test_pretokenizer_differs_from_regex_on_non_ascii_punctuation():
    """ds4.c counts every non-ASCII byte as a letter, so full-width punctuation joins the word."""
    split = pre_tokenizers.Split(Regex(JOYAI_REGEX), behavior="isolated")
    text = "中文，还有。 ok"
    assert pretokenize(text) == ["中文".encode(), "，还有。".encode(), b" ok"]
    assert [p for p, _ in split.pre_tokenize_str(text)] == ["中文", "，", "还有", "。", " ok"]


def test_pretokenizer_known_splits():
    assert pretokenize("    int x") == [b"   ", b" int", b" x"]
    assert pretokenize("12345") == [b"123", b"45"]
    assert pretokenize("a;\n\nb") == [b"a", b";\n\n", b"b"]
    assert pretokenize(".append(") == [b".append", b"("]
    assert pretokenize("中文abc") == ["中文".encode(), b"abc"]
    emoji = next(t for t in TEXTS if t.startswith("emoji"))
    assert b"".join(pretokenize(emoji)) == emoji.encode()


def test_chat_prompt_think_modes(oracle_vocab):
    tk = Tokenizer(*oracle_vocab)
    body = tk.encode("hi")
    assert tk.chat_prompt("hi") == [0, 258] + body + [259, 261]
    assert tk.chat_prompt("hi", think="high") == [0, 258] + body + [259, 260]
    sys_ids = tk.encode("be brief")
    assert tk.chat_prompt("hi", "be brief", "high") == [0] + sys_ids + [258] + body + [259, 260]
    assert tk.chat_prompt("hi", think="max") == [0] + tk.encode(REASONING_EFFORT_MAX_PREFIX) + [258] + body + [259, 260]
    with pytest.raises(TokenizerError, match="think"):
        tk.chat_prompt("hi", think="deep")


def test_rendered_chat_recognises_specials(oracle_vocab):
    tk = Tokenizer(*oracle_vocab)
    text = "<｜begin▁of▁sentence｜>sys<｜User｜>hi there<｜Assistant｜></think>ok"
    assert tk.encode_rendered_chat(text) == [0] + tk.encode("sys") + [258] + tk.encode("hi there") + [259, 261] + tk.encode("ok")
    assert tk.decode(tk.encode_rendered_chat(text)) == text


def test_stream_decoder_holds_back_partial_utf8(oracle_vocab):
    tk = Tokenizer(*oracle_vocab)
    ids = tk.encode("é中😀")
    dec = tk.stream_decoder()
    assert "".join(dec(i) for i in ids) == "é中😀"


def test_errors(oracle_vocab):
    tokens, merges = oracle_vocab
    with pytest.raises(TokenizerError, match="User"):
        Tokenizer([t for t in tokens if t != "<｜User｜>"], merges)
    with pytest.raises(TokenizerError, match="empty"):
        Tokenizer([], merges)
    tk = Tokenizer(tokens, merges)
    with pytest.raises(TokenizerError, match=r"token id: expected an integer in \[0, 1023\], got 4096"):
        tk.decode([5, 4096])
    with pytest.raises(TokenizerError, match="merges"):
        Tokenizer.from_metadata({"tokenizer.ggml.tokens": tokens})


@pytest.fixture(scope="module", params=["oracle", "bundled", "trained"])
def ds4c_tokenizer(request, oracle_dir, oracle_vocab):
    """(ds4ref Tokenizer, ds4.c's own tokenizer output) on one vocab: the oracle model's (761 merges), the
    synthetic model's (the writer's BPE on its corpus; key "bundled") or the bundled trained model's
    (BPE on the standard library's docstrings; key "trained"). Recorded by tools/ds4c/record.py through ds4.h
    (ds4_tokenize_text, ds4_tokenize_rendered_chat, ds4_encode_chat_prompt, ds4_token_text) into
    data/oracle/ds4c_tokenizer.json."""
    import hashlib
    from ds4ref.dev.writer import synthetic_model_path
    rec = json.loads((oracle_dir / "ds4c_tokenizer.json").read_text())
    if request.param == "oracle":
        return Tokenizer(*oracle_vocab), rec
    from ds4ref.bundled import default_model_path
    rec = rec[request.param]
    path = synthetic_model_path() if request.param == "bundled" else default_model_path()
    assert hashlib.sha256(path.read_bytes()).hexdigest() == rec["model_sha256"], f"{path} is not the model ds4.c ran"
    return Tokenizer.from_metadata(GGUFFile(path).metadata), rec


def test_encode_equals_ds4c(ds4c_tokenizer):
    tok, rec = ds4c_tokenizer
    assert len(rec["texts"]) >= 20 and any(len(ids) > 10 for ids in rec["tokenize"])
    for text, ids in zip(rec["texts"], rec["tokenize"], strict=True):
        assert tok.encode(text) == ids, text


def test_rendered_chat_equals_ds4c(ds4c_tokenizer):
    tok, rec = ds4c_tokenizer
    for text, ids in zip(rec["rendered"], rec["rendered_ids"], strict=True):
        assert tok.encode_rendered_chat(text) == ids, text


def test_chat_prompt_equals_ds4c_in_every_think_mode(ds4c_tokenizer):
    tok, rec = ds4c_tokenizer
    modes = set()
    for (system, prompt, think), ids in zip(rec["chats"], rec["chat_ids"], strict=True):
        assert tok.chat_prompt(prompt, system=system or None, think=think) == ids, (system, prompt, think)
        modes.add(think)
    assert modes == {"none", "high", "max"}


def test_token_bytes_equal_ds4c_token_text(ds4c_tokenizer):
    tok, rec = ds4c_tokenizer
    ref = [bytes.fromhex(h) for h in rec["token_text_hex"]]
    assert len(ref) == tok.n_vocab
    assert [tok.token_bytes(i) for i in range(tok.n_vocab)] == ref


def _bpe_reference(tk: Tokenizer, piece: bytes) -> list[int]:
    """ds4.c's bpe_emit_piece rule written plainly: after each merge rescan every adjacent pair and merge the
    one with the lowest rank, the leftmost on ties (quadratic; the rule Tokenizer.bpe must reproduce)."""
    sym = [BYTE_TO_CHAR[b] for b in piece]
    while True:
        live = [(tk.merge_rank[f"{a} {b}"], i) for i, (a, b) in enumerate(zip(sym, sym[1:]))
                if f"{a} {b}" in tk.merge_rank]
        if not live:
            break
        _, i = min(live)
        sym[i:i + 2] = [sym[i] + sym[i + 1]]
    out = []
    for t in sym:
        out += ([tk.token_to_id[t]] if t in tk.token_to_id else
                [tk.token_to_id[chr(b)] for b in t.encode() if b < 128 and chr(b) in tk.token_to_id])
    return out


def test_fast_bpe_makes_the_merges_of_the_plain_rule(ds4c_tokenizer):
    """Tokenizer.bpe (a heap of candidate pairs) equals the plain rescan-every-pair rule id for id: on every
    piece of the recorded texts and chats, and on 600 random pieces over the vocab's merge alphabet, half of
    them runs of merged symbols (long pieces, repeats that tie, spaces and non-ASCII bytes included)."""
    tok, rec = ds4c_tokenizer
    pieces = [p for text in rec["texts"] + rec["rendered"] for p in pretokenize(text)]
    halves = sorted({h for m in tok.merge_rank for h in m.split(" ")})
    alphabet = sorted(set("".join(halves)))
    rnd = random.Random(8)
    for k in range(600):
        n = rnd.randint(1, 120)
        s = ("".join(rnd.choice(alphabet) for _ in range(n)) if k % 2 else
             "".join(rnd.choice(halves) for _ in range(n // 4 + 1)) * rnd.randint(1, 3))
        pieces.append(bytes(CHAR_TO_BYTE[c] for c in s))
    pieces += [b"the" * 40, b"a" * 97, b" " * 33]
    merged = 0
    for piece in pieces:
        ids = tok.bpe(piece)
        assert ids == _bpe_reference(tok, piece), piece
        merged += len(piece) - len(ids)
    assert merged > 3000           # the merges really fire


def test_bpe_of_a_200k_letter_word_finishes():
    """One 200,000-letter pre-token (no spaces) encodes and round-trips well within the timeout; the old
    rescan-every-pair loop took minutes (a timeout, not a timing: the test only fails on a hang)."""
    code = ("from ds4ref.bundled import default_model_path\n"
            "from ds4ref.gguf import GGUFFile\n"
            "from ds4ref.tokenizer import Tokenizer\n"
            "import random\n"
            "tk = Tokenizer.from_metadata(GGUFFile(default_model_path()).metadata)\n"
            "r = random.Random(0)\n"
            "for w in ('the' * 66667, ''.join(r.choice('etaoinshrdlu') for _ in range(200000))):\n"
            "    ids = tk.encode(w)\n"
            "    assert tk.decode(ids) == w and len(ids) < 0.8 * len(w), len(ids)\n"
            "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]

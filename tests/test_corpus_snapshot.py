"""data/trained/corpus_streams.npz, appendix B.9's corpus without its text: it holds the
recorded counts, and rebuilt from the standard library that is the recorded corpus
(CPython 3.11.7's) it is the shipped file, bit for bit."""
from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest

from ds4ref.train.corpus import (HELDOUT_EVERY, corpus_snapshot, split_documents,
                                 stdlib_docstrings, write_snapshot)

ROOT = Path(__file__).resolve().parents[1]
REC = json.loads((ROOT / "book" / "results" / "trained.json").read_text())
SNAP = ROOT / "data" / "trained" / "corpus_streams.npz"


def test_snapshot_holds_the_recorded_corpus():
    s = np.load(SNAP)
    assert str(s["sha256"]) == REC["corpus"]["sha256"]
    assert len(s["doc_file"]) == len(s["doc_tokens"]) == REC["corpus"]["documents"]
    assert len(s["train"]) == REC["train_tokens"]
    assert len(s["heldout"]) == REC["heldout_tokens"]
    held = np.arange(len(s["doc_file"])) % HELDOUT_EVERY == HELDOUT_EVERY - 1
    for stream, docs in ((s["train"], ~held), (s["heldout"], held)):
        ends = np.cumsum(s["doc_tokens"][docs])          # BOS doc EOS, document by document
        assert ends[-1] == len(stream)
        assert (stream[ends - s["doc_tokens"][docs]] == 0).all() and (stream[ends - 1] == 1).all()
    assert SNAP.stat().st_size < 1.5e6


def test_snapshot_rebuilds_bit_for_bit_from_the_recorded_standard_library(tmp_path):
    import sys

    from ds4ref.engine import Engine
    new = corpus_snapshot(Engine.open(backend="numpy").tokenizer)
    if str(new["sha256"]) != REC["corpus"]["sha256"]:
        pytest.skip(f"this Python's standard library (Python {sys.version.split()[0]}) is not "
                    f"the recorded corpus (Python {REC['corpus']['python']}, sha256 "
                    f"{REC['corpus']['sha256'][:16]}...): the snapshot cannot be rebuilt here")
    write_snapshot(tmp_path / "rebuilt.npz", new)
    with zipfile.ZipFile(SNAP) as a, zipfile.ZipFile(tmp_path / "rebuilt.npz") as b:
        assert a.namelist() == b.namelist()
        for name in a.namelist():                      # each .npy: header and data
            assert a.read(name) == b.read(name), name


def test_snapshot_is_the_split_corpus_as_the_training_loop_streams_it(tmp_path):
    """On a made-up library of 2 files and 25 documents (one tokenizer token per byte),
    the snapshot's streams are token_stream's of split_documents, B.5's."""
    pytest.importorskip("torch")
    from ds4ref.train.loop import token_stream

    class Bytes:
        tokens = ["<bos>", "<eos>"] + [chr(i) for i in range(256)]

        def encode(self, d: str) -> list[int]:
            return [2 + b for b in d.encode()]

    def module(n: int, doctest: bool) -> str:
        ex = "\n\n    >>> f(1)\n    2" if doctest else ""
        fns = "".join(f'def f{i}():\n    """Function number {i} of this module, with '
                      f'its words.{ex}"""\n\n' for i in range(n))
        return '"""A module of the made-up library, long enough to be kept."""\n' + fns

    (tmp_path / "a.py").write_text(module(9, doctest=False))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "b.py").write_text(module(14, doctest=True))
    (tmp_path / "test").mkdir()                          # skipped, as in the library
    (tmp_path / "test" / "c.py").write_text(module(3, doctest=False))
    tok = Bytes()
    s = corpus_snapshot(tok, tmp_path)
    docs = stdlib_docstrings(tmp_path)
    train, held = split_documents(docs)
    assert len(docs) == 25 and len(held) == 1
    assert s["train"].tolist() == token_stream(tok, train).tolist()
    assert s["heldout"].tolist() == token_stream(tok, held).tolist()
    assert s["files"].tolist() == ["a.py", "pkg/b.py"]
    assert s["doc_file"].tolist() == [0] * 10 + [1] * 15
    assert s["doc_doctest"].tolist() == [False] * 11 + [True] * 14
    assert s["doc_tokens"].tolist() == [len(tok.encode(d)) + 2 for d in docs]

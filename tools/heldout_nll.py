"""Record the bundled model's per-token NLL on data/trained/heldout.txt (appendix B.8 reads it).

The numpy reference scores the file as `ship` did when it recorded the held-out perplexity
(`sequence_nll`: one cache, BOS then the text): `nll`, float64 [1035], -log p of each next
token, with the machine and commit in a JSON beside it. The digits are this machine's
(rounding chaos moves them with the BLAS kernel); tests/test_trained.py scores the file
afresh and holds both the fresh run and this record to the same bounds.

    .venv/bin/python tools/heldout_nll.py [--out book/results/heldout_nll.npz]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from oracle_rows import write_record  # noqa: E402 (tools/: the recorders share it)


def heldout_nll(engine) -> np.ndarray:
    """-log p(next token) over BOS + heldout.txt with this engine: float64 [n_tokens]."""
    from ds4ref.train.perplexity import sequence_nll
    text = (ROOT / "data" / "trained" / "heldout.txt").read_text()
    ids = [0] + engine.tokenizer.encode(text)
    return sequence_nll(engine.cfg, engine.weights, ids, engine.backend)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "book/results/heldout_nll.npz"))
    args = ap.parse_args(argv)
    from ds4ref.engine import Engine
    write_record(Path(args.out), {"nll": heldout_nll(Engine.open(backend="numpy"))},
                 "the bundled model's per-token NLL on data/trained/heldout.txt "
                 "(tools/heldout_nll.py)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

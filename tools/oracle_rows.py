"""Record ds4ref's free-running replays of every rebuild case (appendix A reads the result).

For each case of data/oracle/rebuilds.json (A, C, bundled, trained) and both paths, the numpy
reference replays ds4.c's golden prompt and steps with its own decisions, and the per-row
agreement with the golden logits is written in rebuilds.npz's layout, under the variant name
"ds4ref": `{case}.{path}.ds4ref.{corr,mean_abs,max_abs,argmax,expert_ids}`, with the machine
and commit in a JSON beside it. Case A's batch path also gives the shadow decisions (the experts
and indexer rows ds4ref's own logic picks from a traced run, free and with ds4's decisions
forced): `A.batch.shadow.{free,forced}.{experts,indexer}.{il}`. The digits are this machine's (rounding chaos moves them with
the BLAS kernel); tests/test_engine.py replays the same runs and holds both the fresh rows
and these to the rebuild yardstick.

    .venv/bin/python tools/oracle_rows.py [--out book/results/oracle_ds4ref.npz]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANT = "ds4ref"


def case_model(case: str, spec: dict):
    """(golden arrays, model path) of one rebuild case."""
    from ds4ref.dev.writer import synthetic_model_path
    golden = np.load(ROOT / spec["golden"])
    path = synthetic_model_path() if spec["model"] == "bundled" else ROOT / spec["model"]
    return golden, path


def replay_rows(engine, golden, path: str) -> dict:
    """One free-running replay's per-row measures against the golden rows, and its
    expert choices on the top-k layers [R, n_routed, 6]."""
    from ds4ref.dev.oracle import golden_rows, logit_agreement, replay_golden, run_rows
    from ds4ref.trace import Trace
    tr, cfg = Trace(names=["exp_ids"]), engine.cfg
    rows = run_rows(replay_golden(engine, golden, path, trace=tr), path)
    routed = [il for il in range(cfg.n_layer) if il >= cfg.n_hash_layer]
    out = logit_agreement(rows, golden_rows(golden, path))
    out["argmax"] = np.argmax(rows, -1)
    out["expert_ids"] = np.stack([tr.series("exp_ids", il)[1] for il in routed], axis=1)
    return out


def shadow_arrays(engine, golden) -> dict:
    """Case A batch's shadow decisions, free and forced, as flat arrays."""
    from ds4ref.dev.oracle import SHADOW_TRACE, replay_golden, shadow_decisions
    from ds4ref.trace import Trace
    out = {}
    for forced in (False, True):
        tr = Trace(names=SHADOW_TRACE)
        replay_golden(engine, golden, "batch", forced=forced, trace=tr)
        got = shadow_decisions(engine.cfg, engine.weights, tr)
        for kind in ("experts", "indexer"):
            for il, v in got[kind].items():
                out[f"A.batch.shadow.{'forced' if forced else 'free'}.{kind}.{il}"] = v
    return out


def shadow_decided(recorded) -> dict:
    """{forced: {"experts": {il: ids}, "indexer": {il: rows}}} back from shadow_arrays."""
    out = {False: {"experts": {}, "indexer": {}}, True: {"experts": {}, "indexer": {}}}
    for k in recorded.files:
        if k.startswith("A.batch.shadow."):
            how, kind, il = k.split(".")[3:]
            out[how == "forced"][kind][int(il)] = recorded[k]
    return out


def write_record(out: Path, arrays: dict, what: str, **meta) -> None:
    """`out` (.npz, compressed) with `arrays`, and a JSON beside it saying what they are,
    the commit and the machine they were computed on (the recording tools share it)."""
    from ds4ref.dev.bench import machine
    np.savez_compressed(out, **arrays)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    meta = {"what": what, "backend": "numpy", **meta, "commit": commit, "machine": machine()}
    out.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    print("wrote", out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "book/results/oracle_ds4ref.npz"))
    args = ap.parse_args(argv)
    from ds4ref.engine import Engine
    cases = json.loads((ROOT / "data/oracle/rebuilds.json").read_text())["cases"]
    arrays = {}
    for case, spec in cases.items():
        golden, model = case_model(case, spec)
        engine = Engine.open(model, backend="numpy")
        for path in ("batch", "stream"):
            for k, v in replay_rows(engine, golden, path).items():
                arrays[f"{case}.{path}.{VARIANT}.{k}"] = v
            print(case, path, "done", flush=True)
        if case == "A":
            arrays.update(shadow_arrays(engine, golden))
    write_record(Path(args.out), arrays,
                 "ds4ref's free replays of the rebuild cases (tools/oracle_rows.py)",
                 cases=list(cases))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Add up the counts of fuzz runs made in parts (`python -m ds4ref.dev.fuzz --first N
--cases M --out PART.json`), one seed, into one results file.

    tools/fuzz_combine.py --planned 100000 --out book/results/fuzz.json PART.json ...

A part cut short (a stopped run) counts the cases its last progress report counted; the
next part starts where that report ended. Each part's range, commit, date and seconds are
kept under "parts"; counts, failures and examples are summed or joined.
"""
from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path


def combine(parts: list[dict], planned: int) -> dict:
    seeds = {p["seed"] for p in parts}
    if len(seeds) != 1:
        raise SystemExit(f"parts of different seeds: {sorted(seeds)}")
    parts = sorted(parts, key=lambda p: p["first"])
    for a, b in zip(parts, parts[1:]):
        if a["first"] + a["cases"] != b["first"]:
            raise SystemExit(f"gap or overlap: cases {a['first']}+{a['cases']} then "
                             f"{b['first']}")
    counts, examples, failures = Counter(), {}, []
    for p in parts:
        counts.update(p["counts"])
        failures += p["failures"]
        for outcome, ex in p["examples"].items():
            examples.setdefault(outcome, [])
            examples[outcome] += ex[:3 - len(examples[outcome])]
    last = parts[-1]
    keep = ("seed", "jobs", "time_limit_s", "memory_gib", "bases", "machine")
    return {"date": last["date"], "commit": last["commit"],
            **{k: last[k] for k in keep}, "first": parts[0]["first"],
            "planned": planned, "cases": sum(p["cases"] for p in parts),
            "seconds": sum(p["seconds"] for p in parts), "counts": dict(counts),
            "failures": failures, "examples": examples,
            "parts": [{k: p[k] for k in ("first", "cases", "commit", "date", "seconds")}
                      for p in parts]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("parts", nargs="+", type=Path)
    ap.add_argument("--planned", type=int, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    res = combine([json.loads(p.read_text()) for p in args.parts], args.planned)
    args.out.write_text(json.dumps(res, indent=1))
    print(f"{res['cases']:,} of {res['planned']:,} cases: {res['counts']}; "
          f"{len(res['failures'])} failures; wrote {args.out}")


if __name__ == "__main__":
    main()

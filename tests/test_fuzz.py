"""Appendix C.5: the GGUF mutator and the fuzz harness, and a few hundred mutants of the
oracle's model and the bundled one opened with no hang, no crash and no exception other
than a named ds4ref error."""
from __future__ import annotations

import json
import os
import random
import signal
import time

import pytest

from ds4ref.bundled import default_model_path
from ds4ref.dev.fuzz import default_bases, fuzz, run_case
from ds4ref.dev.mutate import MUTATIONS, mutant, parse_layout
from ds4ref.gguf import GGUFError, GGUFFile


@pytest.fixture(scope="module")
def bases(oracle_gguf):
    return [oracle_gguf, default_model_path()]


def test_layout_writes_each_model_back_byte_for_byte(bases):
    for path in bases:
        raw = path.read_bytes()
        layout = parse_layout(raw)
        with GGUFFile(path) as g:
            assert len(layout.kvs) == len(g.metadata) and len(layout.tensors) == len(g.tensors)
            assert [t.name.decode() for t in layout.tensors] == list(g.tensors)
        assert layout.to_bytes() == raw


def test_every_mutation_changes_the_file_and_cases_are_reproducible(bases):
    base = parse_layout(bases[0].read_bytes())
    raw = base.to_bytes()
    for name, mutate in MUTATIONS.items():
        changed = 0
        for k in range(8):                      # some draws of a kind may be no-ops
            copy = parse_layout(raw)
            label = mutate(random.Random(k), copy)
            assert isinstance(label, str) and label
            changed += copy.to_bytes() != raw
        assert changed >= 6, name
    assert mutant(base, 3, 17) == mutant(base, 3, 17)
    assert mutant(base, 3, 17) != mutant(base, 3, 18) and mutant(base, 3, 17) != mutant(base, 4, 17)
    assert base.to_bytes() == raw               # mutants are made on copies


def test_mutations_of_a_mutated_record_stay_bounded(bases):
    """Cases whose mutations meet: an array whose length lies, then one of its items (case
    6439 of seed 0 once looped over 2^63 items), and raw edits on a file an earlier edit cut
    shorter than its header (case 8182 once indexed past its end). Each is written, and
    labelled for what it could do."""
    layouts = [parse_layout(p.read_bytes()) for p in default_bases()]
    data, labels = mutant(layouts[6439 % 2], 0, 6439)
    assert labels == ["tensor.type", "array.length", "array_item.none"]
    data, labels = mutant(layouts[8182 % 2], 0, 8182)
    assert isinstance(data, bytes) and len(labels) >= 2


def _sleep(path):
    time.sleep(60)


def _spin(path):
    while True:
        pass


def _segfault(path):
    os.kill(os.getpid(), signal.SIGSEGV)


def _key_error(path):
    raise KeyError("boom")


def _gguf_error(path):
    raise GGUFError("named")


def _allocate(path):
    return len(bytearray(8 << 30))


def _accept(path):
    return "finite"


@pytest.mark.parametrize("target, outcome", [
    (_accept, "accepted"), (_gguf_error, "named:GGUFError"), (_key_error, "other:KeyError"),
    (_allocate, "other:MemoryError"), (_spin, "hang"), (_sleep, "hang"),
    (_segfault, "crash")])
def test_harness_sorts_each_outcome(tmp_path, target, outcome):
    """A child that returns, raises a named or another error, outgrows its address space,
    spends its CPU time, waits past the wall limit or dies of a signal: the parent tells
    which, and goes on."""
    t0 = time.monotonic()
    got, detail = run_case(b"GGUF", tmp_path / "m.gguf", time_limit=1.0, memory=1 << 30,
                           target=target, wall_limit=30.0 if target is _spin else 3.0)
    assert got == outcome, detail
    assert ("CPU" in detail) == (target is _spin) and time.monotonic() - t0 < 60


def test_jobs_run_side_by_side_and_count_every_case(bases, tmp_path):
    res = fuzz(bases, cases=6, seed=9, jobs=3, time_limit=1.0, wall_limit=2.0, target=_sleep)
    assert res["counts"] == {"hang": 6}
    assert sorted(f["case"] for f in res["failures"]) == list(range(6))
    json.dumps(res)                             # the report is plain JSON


def test_300_mutants_give_no_hang_crash_or_unnamed_exception(bases):
    """Each mutant opened with Engine.open on numpy, 3 tokens synced and one evaluated, in a
    forked child with 10 s and 4 GiB: accepted or a named DS4RefError, nothing else."""
    res = fuzz(bases, cases=300, seed=2026, jobs=2)
    assert sum(res["counts"].values()) == 300
    assert not res["failures"], res["failures"][:5]
    assert res["counts"].get("named:GGUFError", 0) > 200 and res["counts"].get("accepted", 0) > 5

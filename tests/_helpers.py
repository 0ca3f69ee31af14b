"""Code the test files share (fixtures: conftest.py): `from _helpers import rel`."""
from __future__ import annotations

from ds4ref.checks import rel  # max |ours - ref| / max |ref| in float64 (the oracle's)
from ds4ref.quant import Q8Act, Q8KAct

__all__ = ["q8", "q8k", "rel"]


def q8(ops, key: str) -> Q8Act:
    """The Q8_0 activation recorded under `key` (`key.qs`, `key.d`) in an ops_*.npz."""
    return Q8Act(ops[key + ".qs"], ops[key + ".d"])


def q8k(ops, key: str, i=None) -> Q8KAct:
    """The Q8_K activation recorded under `key` (`.qs`, `.d`, `.bsums`), or row(s) i."""
    fields = [ops[f"{key}.{f}"] for f in ("qs", "d", "bsums")]
    return Q8KAct(*(v if i is None else v[i] for v in fields))

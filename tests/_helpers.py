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


# The sub-layer objects of chapters 6 and 7 (Attention, MoE) run T tokens at once; these
# call them the way the tests of one token at a time, or of a batch from position pos0,
# want, with a plain trace(name, value) and a recorded decision to replay.

def _run_sublayer(make, il: int, pos0: int, n: int, trace, force_kind, force, per_token):
    import numpy as np
    from ds4ref.trace import NO_TRACE, Hooks, Trace
    table = None
    if force is not None:
        rows = np.asarray(force)
        rows = rows[None] if per_token else rows
        table = np.full((pos0 + len(rows),) + rows.shape[1:], -1, rows.dtype)
        table[pos0:] = rows
    tr = NO_TRACE if trace is None else Trace()
    out = make(Hooks(trace=tr, force=None if table is None else {force_kind: {il: table}}))
    if trace is not None:
        for key, v in tr.data.items():
            _, p, name = key.split(".", 2)
            trace(name if per_token else f"{p}.{name}", v)
    return out


def attention_one(cfg, lw, cache, X, pos, be=None, trace=None, force_indexer=None):
    """Chapter 6's Attention on one token: X [n_hc, n_embd] at pos -> [n_hc, n_embd];
    trace(name, value) gets ds4.c's names, force_indexer the recorded rows."""
    from ds4ref.attention_layer import Attention
    from ds4ref.backend import NUMPY
    return _run_sublayer(lambda h: Attention(cfg, lw, be or NUMPY)(X[None], cache, pos, h)[0],
                         lw.il, pos, 1, trace, "indexer", force_indexer, True)


def attention_batch(cfg, lw, cache, Xs, pos0, be=None, trace=None, force_indexer=None):
    """Attention on the T tokens Xs [T, n_hc, n_embd] at pos0..; trace names P{pos}.name."""
    from ds4ref.attention_layer import Attention
    from ds4ref.backend import NUMPY
    return _run_sublayer(lambda h: Attention(cfg, lw, be or NUMPY)(Xs, cache, pos0, h),
                         lw.il, pos0, len(Xs), trace, "indexer", force_indexer, False)


def ffn_one(cfg, lw, X, token, be=None, trace=None, force_experts=None, pos=0):
    """Chapter 7's MoE on one token: X [n_hc, n_embd] -> [n_hc, n_embd]."""
    import numpy as np
    from ds4ref.backend import NUMPY
    from ds4ref.moe import MoE
    return _run_sublayer(lambda h: MoE(cfg, lw, be or NUMPY)(X[None], np.array([token]),
                                                              pos, h)[0],
                         lw.il, pos, 1, trace, "experts", force_experts, True)


def ffn_batch(cfg, lw, Xs, tokens, be=None, trace=None, force_experts=None, pos0=0):
    """MoE on T tokens Xs [T, n_hc, n_embd] with their ids; trace names P{pos}.name."""
    import numpy as np
    from ds4ref.backend import NUMPY
    from ds4ref.moe import MoE
    return _run_sublayer(lambda h: MoE(cfg, lw, be or NUMPY)(Xs, np.asarray(tokens), pos0, h),
                         lw.il, pos0, len(Xs), trace, "experts", force_experts, False)


def routed_one(cfg, lw, f, token, be=None, trace=None):
    """Chapter 7's routing and routed experts on one token: f [n_embd] -> moe_out [n_embd];
    trace(name, value) gets the router's and the experts' values by ds4.c's names."""
    import numpy as np
    from ds4ref.backend import NUMPY
    from ds4ref.moe import routed_moe, router_weights, select_experts
    from ds4ref.trace import named_values
    be = be or NUMPY
    w, f = be.place_layer(lw), np.asarray(f, np.float32)[None]
    route, ids = select_experts(cfg, w, f, np.array([token]), be)
    weights = router_weights(route.probs, ids, cfg)
    r = routed_moe(cfg, w, f, ids, weights, be)
    if trace is not None:
        values = {"router": route, "exp_ids": ids, "exp_weights": weights,
                  "q8k.ffn_gate_up_exps": r.xq, "exp_mid": r.mid, "q8k.ffn_down_exps": r.midq,
                  "moe_out": r.out}
        for name, v in named_values(values):
            trace(name, be.download(v)[0])
    return be.download(r.out)[0]


def one_token(a):
    """A Q8_0 / Q8_K activation with a leading token axis of 1 (the kernels take [T, ...])."""
    return type(a)(*(f[None] for f in a))


def mid_one(be, w_gate3, w_up3, ids, weights, a, clamp=10.0):
    """be.experts_mid for one token: ids [k], weights [k], a one Q8_K row -> mid [k, n_ff]."""
    import numpy as np
    return be.experts_mid(w_gate3, w_up3, np.asarray(ids)[None], np.asarray(weights)[None],
                          one_token(a), clamp)[0]


def down_one(be, w_down3, ids, a):
    """be.experts_down for one token: ids [k], a the k Q8_K mid rows -> moe [n_embd]."""
    import numpy as np
    return be.experts_down(w_down3, np.asarray(ids)[None], one_token(a))[0]


def attention_of(be, q, kv, sinks, allowed=None, n_raw=None):
    """be.attention over rows kv [R, D] whose first n_raw are raw (None: all), allowed the mask of
    the rest: attention_rows' arguments."""
    n = len(kv) if n_raw is None else n_raw
    if n_raw is None and allowed is not None:
        n = 0
    return be.attention(q, kv[:n], kv[n:], sinks, allowed)

"""The learner's check: each marked function of a core chapter against ds4.c's recorded
values (data/oracle/ops_A.npz, golden_C.npz) or, for the file format and the decoders,
the `gguf` package, case by case in book order; the first case that differs is named
in the reader's terms (op, layer, position, index, expected against got, bound).

The bounds are the chapters' own (the ones they print and assert)."""
from __future__ import annotations

import io
import time
from contextlib import redirect_stdout
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ds4ref.bundled import data_path
from ds4ref.checks import rel
from learn import (CORE, LIMIT, STUB, LearnError, TimeLimit, load, marked,
                   notebook_path, read_notebook, time_limit, why_missing)


# what each function is checked against (default: ds4.c's recorded values)
REFERENCE = {"parse_metadata": "the gguf package's reader",
             "parse_tensors": "the gguf package's reader",
             "_dequantize_q8_0": "the gguf package's decoding",
             "unpack_iq2_xxs_indices": "the gguf package's decoding"}


@dataclass
class Result:
    name: str
    status: str       # "ok", "todo" (not written yet), "differs", "error"
    message: str


class Undefined(Exception):
    """The learner's namespace lacks a name the check calls."""

    def __str__(self) -> str:
        return (f"the notebook defines no `{self.args[0]}` (the check calls it): renamed "
                "or deleted, or its cell lost its `#| export` line?")


def defined(ns: dict, name: str):
    """ns[name], or Undefined naming it (a learner may rename or delete anything)."""
    if name not in ns:
        raise Undefined(name)
    return ns[name]


@lru_cache(maxsize=None)
def oracle():
    """(ops_A, cfg, weights, positions) of the tiny model's case A."""
    from ds4ref.weights import load_model
    ops = np.load(data_path("oracle") / "ops_A.npz")
    _, cfg, W = load_model(data_path("oracle") / "dev_seed1.gguf")
    return ops, cfg, W, [int(p) for p in ops["positions"]]


def _at(idx, axes) -> str:
    """An index in words: axes is a tuple of axis names, or a list naming each element
    of a 1-d result."""
    if isinstance(axes, list):
        return axes[idx[0]]
    names = axes or ()
    parts = [f"{names[i]} {v}" if i < len(names) else str(v) for i, v in enumerate(idx)]
    return "[" + ", ".join(parts) + "]"


def differs(got, want, bound, axes=None) -> str | None:
    """None when got matches want (exactly when bound is None, else max rel err <=
    bound); else where and by how much, in words."""
    kind = kind_problem(got, want)
    if kind:
        return kind
    want = np.asarray(want)
    try:
        got = np.asarray(got, dtype=want.dtype)
    except (TypeError, ValueError) as e:
        return f"returned {type(got).__name__}, not an array ({e})"
    if got.shape != want.shape:
        return f"shape {got.shape}, expected {want.shape}"
    if bound is None:
        bad = np.argwhere(got != want)
        if not len(bad):
            return None
        if want.ndim == 0:
            return f"expected {want.item()!r}, got {got.item()!r} (must be equal)"
        i = tuple(int(v) for v in bad[0])
        return (f"first difference at {_at(i, axes)}: expected {want[i].item()!r}, "
                f"got {got[i].item()!r} (must be equal; {len(bad)} of {want.size} "
                "differ)")
    g64, w64 = got.astype(np.float64), want.astype(np.float64)
    err = rel(g64, w64) if np.isfinite(g64).all() else float("inf")
    if err <= bound:
        return None
    d = np.where(np.isfinite(g64), np.abs(g64 - w64), np.inf)
    i = tuple(int(v) for v in np.unravel_index(int(np.argmax(d)), d.shape))
    return (f"largest difference at {_at(i, axes)}: expected {float(want[i]):.7g}, "
            f"got {float(got[i]):.7g} (max rel err {err:.1e}, bound {bound:.0e})")


def kind_problem(got, want) -> str | None:
    """What is wrong with the kind of what the learner returned, before its values:
    None (a forgotten `return`), a list where ds4.c's values are an array, a dtype
    other than ds4.c's (float64 hides in a float32 comparison; floats in an index)."""
    if got is None:
        return "returned None (a missing `return`?)"
    if not isinstance(want, np.ndarray):
        return None                     # a list or a number: compared by value
    if not isinstance(got, (np.ndarray, np.generic)):
        return (f"returned {type(got).__name__}, not a numpy array (expected "
                f"{want.dtype} {want.shape})")
    if want.dtype.kind == "f" and got.dtype != want.dtype:
        return f"dtype {got.dtype}, expected {want.dtype} (as ds4.c computes it)"
    if want.dtype.kind in "iub" and got.dtype.kind not in "iub":
        return f"dtype {got.dtype}, expected integers ({want.dtype})"
    return None


def run_cases(ns: dict, name: str, cases, limit: float | None = LIMIT) -> Result:
    """Run one function's cases in order and stop at the first that differs; what
    it prints is held back, so that the report stays readable."""
    out = io.StringIO()
    with redirect_stdout(out):
        r = _run_cases(ns, name, cases, limit)
    lines = [line for line in out.getvalue().splitlines()
             if ": not written yet, running the book's" not in line]
    if lines:
        r.message += (f" (it printed {len(lines)} lines, not shown; the first: "
                      f"{lines[0][:60]!r})")
    return r


def _run_cases(ns, name, cases, limit) -> Result:
    strict = ns.setdefault("STRICT", set())
    strict.add(name)
    n, left, cases = 0, limit, iter(cases)
    try:
        while True:
            try:
                # the check's own setup (the oracle, an engine) is not on the clock
                where, got_fn, want, bound, axes = next(cases, (None,) * 5)
                if got_fn is None:
                    break
                start = time.monotonic()
                with time_limit(left, name):
                    got = got_fn()
                    # want None: the case judged itself (None, or what is wrong)
                    msg = got if want is None else differs(got, want, bound, axes)
                if left is not None:
                    left -= time.monotonic() - start
            except NotImplementedError as e:
                stub = str(e).split(": write")[0]
                if str(e).startswith(STUB.format(name=stub)):
                    return Result(name, "todo", "not written yet" if stub == name else
                                  f"needs {stub}, not written yet")
                return Result(name, "error", f"{where}: NotImplementedError: {e}")
            except Undefined as e:
                return Result(name, "error", str(e))
            except TimeLimit:
                return Result(name, "error", f"{where}: still running after {limit:g} "
                              f"s, all its cases together (an endless loop?); {n} "
                              "cases agreed before it; --time-limit SECONDS allows "
                              "longer")
            except SystemExit as e:
                return Result(name, "error", f"{where}: calls sys.exit({e.code!r})")
            except Exception as e:     # the learner's code: report, never crash
                return Result(name, "error", f"{where}: {type(e).__name__}: {e}")
            if msg:
                return Result(name, "differs", f"{where}: {msg}")
            n += 1
    finally:
        strict.discard(name)
    return Result(name, "ok", f"agrees with {REFERENCE.get(name, 'ds4.c')} in all {n} "
                  "cases")


# --- chapter 01 and 02: the file and the decoders, against the gguf package --------

def _reader():
    import gguf
    return gguf.GGUFReader(data_path("oracle") / "dev_seed1.gguf")


def _opened(ns, got):
    """The oracle's GGUF read (once) by the notebook's three steps: header, metadata,
    tensor directory (a later cell imports the package's GGUFFile over the notebook's,
    so the steps are called here by name)."""
    if "f" not in got:
        from types import SimpleNamespace
        c = defined(ns, "_Cursor")((data_path("oracle") / "dev_seed1.gguf")
                                   .read_bytes())
        _, n_tensors, n_kv = defined(ns, "parse_header")(c)
        metadata, _, alignment = defined(ns, "parse_metadata")(c, n_kv)
        tensors, _, _ = defined(ns, "parse_tensors")(c, n_tensors, alignment)
        got["f"] = SimpleNamespace(metadata=metadata, alignment=alignment,
                                   tensors=tensors)
    return got["f"]


def check_parse_metadata(ns):
    r, got = _reader(), {}
    keys = [k for k in r.fields if not k.startswith("GGUF.")]
    yield ("the metadata keys, in file order", lambda: list(_opened(ns, got).metadata),
           keys, None, None)
    for key in ("deepseek4.block_count", "deepseek4.embedding_length",
                "general.alignment", "deepseek4.expert_count"):
        f = r.fields.get(key)
        if f is None:
            continue
        yield (f"metadata {key!r}", lambda key=key: _opened(ns, got).metadata[key],
               f.contents(), None, None)
    yield ("the alignment", lambda: _opened(ns, got).alignment,
           int(r.alignment), None, None)


def check_parse_tensors(ns):
    r, got = _reader(), {}
    yield ("the tensor count", lambda: len(_opened(ns, got).tensors), len(r.tensors),
           None, None)
    for t in r.tensors:
        def entry(t=t):
            ti = got["f"].tensors.get(t.name)
            if ti is None:
                raise KeyError(f"no tensor {t.name!r} in .tensors")
            return [int(ti.ggml_type), *map(int, ti.shape), int(ti.offset),
                    int(ti.nbytes)]
        want = [int(t.tensor_type), *map(int, t.shape), int(t.data_offset),
                int(t.n_bytes)]
        fields = ["the type", *[f"dim {d}" for d in range(len(t.shape))],
                  "the data offset", "the byte count"]
        yield (f"tensor {t.name!r} (type, shape, offset, nbytes)", entry, want, None,
               fields)


def _tensors(ggml_type: int, n: int = 3):
    r = _reader()
    return [t for t in r.tensors if int(t.tensor_type) == ggml_type][:n]


def _dequant_cases(decode, ggml_type: int, per_block: int):
    from gguf.quants import dequantize
    for t in _tensors(ggml_type):
        raw = np.asarray(t.data).view(np.uint8).reshape(-1, t.data.shape[-1])
        raw = raw[:8]                                          # [rows, row bytes]
        want = dequantize(raw, t.tensor_type).astype(np.float32)  # [rows, n]

        def got(raw=raw, want=want):
            out = decode(raw)           # [rows, nb, block]: compared as [rows, n]
            ok = isinstance(out, np.ndarray) and out.size == want.size
            return out.reshape(want.shape) if ok else out
        yield (f"tensor {t.name!r}, rows 0-7, as `gguf` dequantizes it", got, want,
               None, ("row", "weight"))


def check_q8_0(ns):
    return _dequant_cases(defined(ns, "_dequantize_q8_0"), 8, 32)


def check_iq2_xxs(ns):
    return _dequant_cases(defined(ns, "_dequantize_iq2_xxs"), 16, 256)


# --- chapters 03-07: ds4.c's recorded ops of case A --------------------------------

def _layer_pos():
    ops, cfg, W, positions = oracle()
    for l in range(cfg.n_layer):
        for p in positions:
            yield l, p, f"L{l}.P{p}."


def check_q8_0_dot(ns):
    from ds4ref.quant import Q8Act
    ops, cfg, W, _ = oracle()
    cases = [("attn_q_a", "q8.attn_q_a", "qr"), ("attn_q_b", "q8.attn_q_b", "q_b"),
             ("attn_kv", "q8.attn_kv", "kv_raw"),
             ("attn_output_b", "q8.attn_output_b", "attn_out"),
             ("ffn_gate_shexp", "q8.ffn_gate_shexp", "shared_gate"),
             ("ffn_up_shexp", "q8.ffn_gate_shexp", "shared_up"),
             ("ffn_down_shexp", "q8.ffn_down_shexp", "shared_out")]
    fn = defined(ns, "matvec_q8_0_prequant")
    for l, p, k in _layer_pos():
        for field, act, out in cases:
            a = Q8Act(ops[k + act + ".qs"], ops[k + act + ".d"])
            yield (f"layer {l}, position {p}: {out} = {field} . {act}",
                   lambda w=getattr(W.layers[l], field), a=a: fn(w, a),
                   ops[k + out].reshape(-1), None, ("row",))


def check_rms_norm(ns):
    ops, cfg, W, _ = oracle()
    fn = defined(ns, "rms_norm_weight")
    for l, p, k in _layer_pos():
        for src, dst, wname in (("attn_x", "attn_norm", "attn_norm"),
                                ("qr", "qr_norm", "attn_q_a_norm"),
                                ("kv_raw", "kv_normed", "attn_kv_a_norm"),
                                ("ffn_x", "ffn_norm", "ffn_norm")):
            yield (f"layer {l}, position {p}: {src} -> {dst}",
                   lambda x=ops[k + src], w=getattr(W.layers[l], wname): fn(x, w),
                   ops[k + dst], 5e-7, ("dim",))


def check_sinkhorn(ns):
    ops, cfg, W, _ = oracle()
    fn = defined(ns, "hc_split_sinkhorn")

    def split(mix, scale, base):
        pre, post, comb = fn(mix, scale, base, cfg.n_hc, cfg.hc_sinkhorn_iter)
        return np.concatenate([np.ravel(pre), np.ravel(post), np.ravel(comb)])
    for l, p, k in _layer_pos():
        for s in ("attn", "ffn"):
            lw = W.layers[l]
            yield (f"layer {l}, position {p}: {s}_hc_mix -> {s}_hc_split "
                   "(pre 0-3, post 4-7, comb 8-23 by source, destination)",
                   lambda m=ops[k + s + "_hc_mix"], sc=getattr(lw, f"hc_{s}_scale"),
                   b=getattr(lw, f"hc_{s}_base"): split(m, sc, b),
                   ops[k + s + "_hc_split"], 5e-7, ("element",))


def check_rope(ns):
    ops, cfg, W, _ = oracle()
    fn = defined(ns, "rope_tail")
    for l, p, k in _layer_pos():
        ratio = cfg.compress_ratios[l]
        for src, dst, window, inverse in (
                ("q_normed", "q_rope", 0, False), ("kv_normed", "kv_rope", 0, False),
                ("heads", "heads_unrope", 0, True),
                ("comp_normed", "comp_rope", 1, False),
                ("icomp_normed", "icomp_rope", 1, False),
                ("idx_q_raw", "idx_q_rope", 0, False)):
            if k + dst not in ops:
                continue
            at = p + 1 - ratio if window else p
            x = ops[k + src]
            yield (f"layer {l} (ratio {ratio}), position {p}: {src} -> {dst}"
                   + (" (inverse)" if inverse else "") + f" at {at}",
                   lambda x=x, at=at, r=ratio, inv=inverse: fn(x, at, cfg, r, inv),
                   ops[k + dst], 5e-7, ("head", "dim") if x.ndim == 2 else ("dim",))


def check_attention(ns):
    ops, cfg, W, _ = oracle()
    fn = defined(ns, "attention_rows")
    for l, p, k in _layer_pos():
        raw = ops[k + "cache_raw"]
        comp = ops.get(k + "cache_comp", np.zeros((0, cfg.head_dim), np.float32))
        allowed = ops.get(k + "comp_allowed")
        kv = np.concatenate([raw, comp])
        yield (f"layer {l}, position {p}: heads from q_rope over {len(raw)} raw + "
               f"{len(comp)} compressed rows",
               lambda q=ops[k + "q_rope"], kv=kv, s=W.layers[l].attn_sinks, a=allowed,
               n=len(raw): fn(q, kv, s, a, n), ops[k + "heads"], 1e-5, ("head", "dim"))


def check_pool(ns):
    ops, cfg, W, _ = oracle()
    fn = defined(ns, "compressor_pool")
    for l, p, k in _layer_pos():
        for nm in ("comp", "icomp"):
            if k + nm + "_state_kv" not in ops:
                continue
            r = cfg.compress_ratio(l)
            yield (f"layer {l} (ratio {r}), position {p}: {nm}_state -> {nm}_pooled",
                   lambda kv=ops[k + nm + "_state_kv"], sc=ops[k + nm + "_state_score"],
                   r=r: fn(kv, sc, r), ops[k + nm + "_pooled"], 1e-6, ("dim",))


def check_indexer_topk(ns):
    ops, cfg, W, _ = oracle()
    fn = defined(ns, "indexer_topk")
    for l, p, k in _layer_pos():
        if k + "idx_selected" in ops and k + "idx_scores" in ops:
            yield (f"layer {l}, position {p}: the top {cfg.indexer_top_k} of "
                   f"{ops[k + 'idx_scores'].size} idx_scores -> idx_selected",
                   lambda s=ops[k + "idx_scores"]: fn(s, cfg.indexer_top_k),
                   ops[k + "idx_selected"], None, ("slot",))


def check_hash(ns):
    from ds4ref.backend import NUMPY
    ops, cfg, W, positions = oracle()
    fn = defined(ns, "hash_selected_experts")
    for l in range(cfg.n_hash_layer):
        lw = NUMPY.place_layer(W.layers[l])
        for p in positions:
            tok = int(ops[f"P{p}.token"][0]) if f"P{p}.token" in ops.files else 0
            yield (f"layer {l} (hash), position {p}, token {tok}: exp_ids",
                   lambda lw=lw, t=tok: fn(lw, t), ops[f"L{l}.P{p}.exp_ids"], None,
                   ("slot",))


def check_topk(ns):
    ops, cfg, W, positions = oracle()
    fn = defined(ns, "topk_selected_experts")
    for l in range(cfg.n_hash_layer, cfg.n_layer):
        bias = W.layers[l].ffn_exp_probs_b.numpy()
        for p in positions:
            yield (f"layer {l} (top-k), position {p}: router_probs + bias -> exp_ids",
                   lambda pr=ops[f"L{l}.P{p}.router_probs"], b=bias:
                   fn(pr, b, cfg.n_expert_used), ops[f"L{l}.P{p}.exp_ids"], None,
                   ("slot",))


# --- chapter 08: the session's sync against ds4.c's run of case C ------------------

def _yardstick(rebuilds, golden, row, index):
    """None when row [V] is within the rebuild yardstick of ds4.c's row `index` of
    case C's batch path, else the measures past their limits."""
    from ds4ref.dev.oracle import YardstickError
    try:
        rebuilds.check_rows("C", "batch", golden, np.asarray(row)[None], [index])
    except YardstickError as e:
        return f"outside the rebuild yardstick of ds4.c's row: {e}"
    return None


def check_sync(ns):
    from ds4ref.dev.oracle import Rebuilds
    from ds4ref.engine import Engine
    golden = np.load(data_path("oracle") / "golden_C.npz")
    rebuilds = Rebuilds(data_path("oracle"))
    eng = Engine.open(data_path("oracle") / "dev_seed1.gguf", backend="numpy")
    box = {}
    prompt = [int(t) for t in golden["prompt_ids"]]
    steps = [int(t) for t in golden["greedy_tokens"]]

    def sync(toks):
        if "s" not in box:
            box["s"] = defined(ns, "Session")(eng, 64)
        return box["s"].sync(toks)

    def within(index):
        return lambda: _yardstick(rebuilds, golden, box["s"].logits, index)
    yield ("sync(case C's 5-token prompt) on a fresh session: tokens computed "
           "(ds4.c prefills them all)", lambda: sync(prompt), len(prompt), None, None)
    yield ("the logits after it, against ds4.c's prompt_logits", within(0), None,
           None, None)
    for i in range(len(steps) - 1):
        toks = prompt + steps[:i + 1]
        yield (f"step {i}: sync(the transcript + greedy token {steps[i]}): tokens "
               "computed (an extension is decoded, ds4.c's policy)",
               lambda toks=toks: sync(toks), 1, None, None)
        yield (f"step {i}: the logits at position {len(toks) - 1}, against ds4.c's "
               f"step_logits[{i}]", within(i + 1), None, None, None)
    edited = prompt[:3] + [9, 10]
    yield ("sync(an edited transcript, the prompt's first 3 tokens + [9, 10]): tokens "
           "computed (anything but an extension is rebuilt)",
           lambda: sync(edited), len(edited), None, None)
    yield ("the session's tokens after the edit", lambda: box["s"].tokens, edited,
           None, ("token",))
    ref = eng.session(64)
    ref.sync(edited)
    yield ("the logits after the edit, against a fresh session of the book's synced "
           "to it", lambda: box["s"].logits, ref.logits, None, ("token id",))


CHECKS = {
    "parse_metadata": check_parse_metadata, "parse_tensors": check_parse_tensors,
    "_dequantize_q8_0": check_q8_0,
    "unpack_iq2_xxs_indices": check_iq2_xxs, "matvec_q8_0_prequant": check_q8_0_dot,
    "rms_norm_weight": check_rms_norm, "hc_split_sinkhorn": check_sinkhorn,
    "rope_tail": check_rope, "attention_rows": check_attention,
    "compressor_pool": check_pool, "indexer_topk": check_indexer_topk,
    "hash_selected_experts": check_hash, "topk_selected_experts": check_topk,
    "Session.sync": check_sync,
}


def check(nn: str, notebook=None, limit: float | None = LIMIT) -> list[Result]:
    """Each marked function of chapter nn, from the learner's notebook (default
    learn/NN_x.ipynb; a chapter itself passes as well), against its reference; limit:
    the seconds each function may run, all its cases together (None: no limit)."""
    names = [q for _, q in marked(nn)]
    if not names:
        raise LearnError(f"chapter {nn}: no function to write (the core chapters, "
                         f"{', '.join(CORE)}, have them)")
    missing = [q for q in names if q not in CHECKS]
    if missing:
        raise LearnError(f"chapter {nn}: no check for {missing} in "
                         "tools/learn_checks.py")
    ns = load(nn, notebook, limit)
    out = []
    for q in names:
        if q.split(".")[0] not in ns:     # read again only to say why
            nb = read_notebook(notebook_path(nn, notebook), nn)
            out.append(Result(q, "error", why_missing(nb, q)))
            continue
        try:
            cases = CHECKS[q](ns)
        except Undefined as e:
            out.append(Result(q, "error", str(e)))
            continue
        out.append(run_cases(ns, q, cases, limit))
    return out


def report(nn: str, results: list[Result]) -> str:
    done = sum(r.status == "ok" for r in results)
    lines = [f"chapter {nn}: {done} of {len(results)} functions agree with ds4.c"]
    for r in results:
        word = {"ok": "ok", "todo": "not written yet (the book's runs meanwhile)",
                "differs": "DIFFERS", "error": "FAILS"}[r.status]
        lines.append(f"  {r.name:24s} {word}" + ("" if r.status == "todo" else
                                                 f": {r.message}"))
    return "\n".join(lines)

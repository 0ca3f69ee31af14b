"""Shared by rebuilds.py and record.py: run a ds4c_run build on one case and read what it wrote."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np

N_ROUTED = 3            # top-k routed layers of the tiny shape (3, 4, 5): the golden traces' middle axis
PATHS = {"stream": ("stream_greedy_tokens", "stream_pos_logits", "stream_step_logits"),
         "batch": ("greedy_tokens", "prompt_logits", "step_logits")}


def golden_rows(g, path: str) -> np.ndarray:
    """The logit rows of one path in order: every stream position (or the prompt), then the steps."""
    _, first, steps = PATHS[path]
    head = g[first] if g[first].ndim == 2 else g[first][None]
    return np.concatenate([head, g[steps]])


def read_expert_log(log: Path, path: str, n_prompt: int, n_steps: int, n_expert: int, k: int = 6):
    """ds4c_run's expert log (shape_patch.py --log-experts: k int32 ids + n_expert float32 scores per call) in
    the golden traces' layout: ids [P+S, 3, k] and margins [P+S, 3] (min chosen score - max other score).
    Calls come position-major on the stream path; the batch prefill is layer-major (layer 3 for every prompt
    token, then 4, then 5), followed by the decode steps position-major."""
    rec = np.fromfile(log, np.uint8).reshape(-1, 4 * (k + n_expert))
    ids = rec[:, :4 * k].copy().view(np.int32)
    scores = rec[:, 4 * k:].copy().view(np.float32)
    chosen = np.zeros(scores.shape, bool)
    np.put_along_axis(chosen, ids.astype(np.int64), True, axis=1)
    margin = np.where(chosen, scores, np.inf).min(1) - np.where(chosen, -np.inf, scores).max(1)
    return tuple(expert_rows(a, path, n_prompt, n_steps) for a in (ids, margin.astype(np.float32)))


def expert_rows(log: np.ndarray, path: str, n_prompt: int, n_steps: int) -> np.ndarray:
    """Per-call rows [calls, ...] in call order -> [P+S, 3, ...] in position order (see read_expert_log)."""
    tail = log.shape[1:] if log.ndim > 1 else ()
    if path == "stream":
        return log.reshape((n_prompt + n_steps, N_ROUTED) + tail)
    pre = np.moveaxis(log[: N_ROUTED * n_prompt].reshape((N_ROUTED, n_prompt) + tail), 0, 1)
    return np.concatenate([pre, log[N_ROUTED * n_prompt:].reshape((n_steps, N_ROUTED) + tail)])


def run(build: Path, model: Path, path: str, prompt: np.ndarray, steps, work: Path, threads: int = 1,
        env: dict | None = None):
    """One replay: path "stream" or "batch"; steps = token ids (teacher forcing) or an int N (N greedy steps
    of ds4's own argmax). env: extra environment (e.g. ds4c_run's DS4C_STEER_* steering options).
    Returns (logits [rows, V], tokens fed as steps, expert log path)."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "ids.bin").write_bytes(np.asarray(prompt, "<i4").tobytes())
    if isinstance(steps, (int, np.integer)):
        steps_arg = f"greedy:{int(steps)}"
    else:
        (work / "steps.bin").write_bytes(np.asarray(steps, "<i4").tobytes())
        steps_arg = str(work / "steps.bin")
    log, out = work / f"{path}.experts", work / "logits.bin"
    log.unlink(missing_ok=True)
    indexer_log(log).unlink(missing_ok=True)
    subprocess.run([str(build / "ds4c_run"), str(model), path, str(work / "ids.bin"), steps_arg, str(out)],
                   check=True, capture_output=True, env=dict(os.environ, DS4C_EXPERT_LOG=str(log),
                                                             DS4C_INDEXER_LOG=str(indexer_log(log)),
                                                             DS4C_THREADS=str(threads), **(env or {})))
    fed = np.fromfile(str(out) + ".tokens", "<i4") if steps_arg.startswith("greedy") else np.asarray(steps)
    n_rows = (len(prompt) if path == "stream" else 1) + len(fed)
    return np.fromfile(out, np.float32).reshape(n_rows, -1), fed, log


def indexer_log(expert_log: Path) -> Path:
    """Where a run's indexer log goes (written only by a build patched with --log-indexer)."""
    return expert_log.with_suffix(".indexer")


def read_indexer_log(log: Path, n_rows: int, layers: tuple, top_k: int = 16) -> np.ndarray:
    """shape_patch.py --log-indexer's records -> selected rows [P+S, len(layers), top_k] in the golden traces'
    layout (increasing row ids; -1 where the layer kept every row). Each record names its layer and position."""
    raw = np.fromfile(log, "<u4") if log.exists() else np.zeros(0, "<u4")
    out, i = np.full((n_rows, len(layers), top_k), -1, np.int32), 0
    while i < len(raw):
        il, pos, _, k = (int(v) for v in raw[i:i + 4])
        out[pos, layers.index(il), :k] = raw[i + 4:i + 4 + k]
        i += 4 + k
    return out

# %% [markdown]
# The ratio-4 state, drawn by running this chapter's own update on token numbers
# instead of vectors. Each token $t$ writes its value row and its score row into row
# $4 + t \bmod 4$ of `state_kv` and `state_score`, both $8 \times 2\,$head_dim, as
# `compressor_decode_one` (l. 6514) does. When a window closes,
# `compressor_pool_decode_state` (l. 6459) reads the first half of the columns from rows
# 0-3, the previous window, and the second half from rows 4-7, the current one. It pools
# those 8 tokens, then copies rows 4-7 up to rows 0-3. The top panel is the state at the
# close of the window at $t = 11$. The bottom panel shows which tokens each compressed
# row pools, and in which half: windows of 8 that step by 4. The indexer's compressor
# has the same layout, with head_dim 128.

# %%
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Rectangle

import ds4ref.compressor as dc
from ds4ref.config import ModelConfig

CMP_PREV, CMP_CUR, CMP_IDLE = "#dde8f5", "#f6d5a8", "#f2f2f2"


def compressor_history(n_tokens, ratio=4):
    """Feed token numbers through the state; per emission: (pos, state copy, halves)."""
    state_kv = np.zeros((2 * ratio, 2), np.float32)     # head_dim 1: a column a half
    state_score = np.full((2 * ratio, 2), dc.NEG_INF, np.float32)
    out = []
    for t in range(n_tokens):
        row = np.full(2, t, np.float32)
        score = np.zeros(2, np.float32)
        if dc.compressor_update_state(state_kv, state_score, row, score, t, ratio):
            live = state_score > dc.NEG_INF * np.float32(0.5)   # rows ever written
            first = state_kv[:ratio, 0][live[:ratio, 0]].astype(int).tolist()
            second = state_kv[ratio:, 1][live[ratio:, 1]].astype(int).tolist()
            assert first + second == list(dc.compressor_window(t, ratio))
            out.append((t, np.where(live, state_kv, -1).astype(int), first, second))
            dc.compressor_advance_state(state_kv, state_score, ratio)
    return out


def draw_state(ax, x0, name, tokens, hd, ratio=4):
    """One state array at an emission: 8 rows x 2 halves, read halves shaded."""
    for r in range(2 * ratio):
        y = 2 * ratio - 1 - r
        for half in range(2):
            read = (r < ratio) == (half == 0)
            color = (CMP_PREV if r < ratio else CMP_CUR) if read else CMP_IDLE
            ax.add_patch(Rectangle((x0 + 4 * half, y), 4, 1, fc=color, ec="#555555",
                                   lw=0.6))
            t = tokens[r, half]
            text = f"t = {t}" + ("" if read else " (unread)")
            ax.text(x0 + 4 * half + 2, y + 0.5, text, ha="center", va="center",
                    fontsize=8, color="k" if read else "#888888")
        ax.text(x0 - 0.3, y + 0.5, f"row {r}", ha="right", va="center", fontsize=8)
    for half, cols in enumerate((f"0..{hd - 1}", f"{hd}..{2 * hd - 1}")):
        ax.text(x0 + 4 * half + 2, 8.2, f"columns {cols}", ha="center", fontsize=8)
    ax.text(x0 + 4, 9.1, name, ha="center", fontsize=9.5, weight="bold")


def draw_windows(ax, history, n_tokens, ratio=4):
    """Tokens on x; one bar per compressed row, split into the halves it reads."""
    for t in range(n_tokens):
        ax.text(t + 0.5, len(history) + 0.35, str(t), ha="center", fontsize=8)
        ax.text(t + 0.5, len(history) + 1.05, str(dc.compressor_state_row(t, ratio)),
                ha="center", fontsize=8, color="#555555")
    ax.text(-0.4, len(history) + 0.35, "token t", ha="right", fontsize=8)
    ax.text(-0.4, len(history) + 1.05, "writes row", ha="right", fontsize=8,
            color="#555555")
    for c, (pos, _, first, second) in enumerate(history):
        y = len(history) - 1 - c
        for toks, color in ((first, CMP_PREV), (second, CMP_CUR)):
            for t in toks:
                ax.add_patch(Rectangle((t, y + 0.1), 1, 0.8, fc=color, ec="#555555",
                                       lw=0.5))
        ax.text(-0.4, y + 0.5, f"compressed row {c}", ha="right", va="center",
                fontsize=8)
        ax.text(pos + 1.3, y + 0.5, f"emitted at pos {pos}, RoPE at {pos + 1 - ratio}",
                va="center", fontsize=8)
    ax.set_xlim(-7, n_tokens + 7)
    ax.set_ylim(-0.2, len(history) + 1.6)
    ax.axis("off")


def draw_compressor_state(cfg, n_tokens=20, show_pos=11):
    history = compressor_history(n_tokens)
    fig, (ax0, ax1) = plt.subplots(2, 1, figsize=(11, 7.2),
                                   gridspec_kw={"height_ratios": [1.25, 1]})
    pos, tokens, first, second = next(h for h in history if h[0] == show_pos)
    hd = cfg.head_dim
    draw_state(ax0, 3, f"state_kv [8 × {2 * hd}]", tokens, hd)
    draw_state(ax0, 17, f"state_score [8 × {2 * hd}]", tokens, hd)
    ax0.text(13, 5.0, f"previous window\nt = {first[0]}..{first[-1]}", ha="center",
             va="center", fontsize=8.5, bbox=dict(fc=CMP_PREV, ec="none"))
    ax0.text(13, 2.0, f"current window\nt = {second[0]}..{second[-1]}", ha="center",
             va="center", fontsize=8.5, bbox=dict(fc=CMP_CUR, ec="none"))
    ax0.text(13, -0.9, "pooled per column j: softmax over the 8 shaded scores, "
             f"weights × the 8 shaded values → one row [{hd}]", ha="center",
             fontsize=9)
    ax0.set_xlim(-1, 26)
    ax0.set_ylim(-1.4, 9.7)
    ax0.axis("off")
    ax0.set_title(f"ratio-4 compressor state when the window closes at t = {pos} "
                  f"(head_dim {hd})", fontsize=10)
    draw_windows(ax1, history, n_tokens)
    ax1.set_title("which tokens each compressed row pools: first half of the columns "
                  "(blue) from the previous 4, second half (orange) from the current 4",
                  fontsize=9.5)
    plt.tight_layout()
    plt.show()


draw_compressor_state(ModelConfig.real())

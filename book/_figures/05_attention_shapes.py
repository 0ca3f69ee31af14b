# %% [markdown]
# The attention sub-layer as shapes, on the real model. The top row is the query path of
# `layer_q_projection_with_lora_one` (l. 4687) and the output path of
# `layer_grouped_out_one` (l. 5020). The second row is the single KV row of
# `layer_kv_projection_normed_one` (l. 4705), which is the key and the value at once.
# Orange marks every step that touches position: RoPE on the last 64 dims, and its
# inverse on the output. The bottom panel asks which 64 dims those are, and which dims
# pair up. It comes from the code itself: `rope_tail` (ds4.c's `rope_tail_ext_inplace`,
# l. 4766) is applied to the 512 unit vectors, and every pair of dims that the rotation
# mixes is drawn as an arc.

# %%
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

import ds4ref.rope as dr
from ds4ref.config import ModelConfig

ATT_BOX, ATT_ROPE, ATT_ATTN = "#dde8f5", "#f6d5a8", "#d9ead3"


def att_box(ax, x, y, w, text, color=ATT_BOX, h=5.0, sub=None):
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, fc=color, ec="k", lw=0.8,
                                boxstyle="round,pad=0.02,rounding_size=0.5"))
    ax.text(x, y, text, ha="center", va="center", fontsize=8.5)
    if sub:
        ax.text(x, y - h / 2 - 0.6, sub, ha="center", va="top", fontsize=7.5,
                color="#555555")


def att_arrow(ax, p0, p1, text=None, dy=0.6):
    ax.add_patch(FancyArrowPatch(p0, p1, arrowstyle="-|>", mutation_scale=10, lw=0.9))
    if text:
        ax.text((p0[0] + p1[0]) / 2, (p0[1] + p1[1]) / 2 + dy, text, ha="center",
                va="bottom", fontsize=8, weight="bold")


def draw_shape_pipeline(ax, cfg):
    """Query and output path (top row), KV row (below); each box ends in its shape."""
    hd, nh, G, tail = cfg.head_dim, cfg.n_head, cfg.n_out_group, cfg.n_rot
    rope = f"RoPE, dims\n{hd - tail}..{hd - 1}"
    top = [("attn_q_a\nQ8_0", f"[{cfg.n_lora_q}]", ATT_BOX),
           ("attn_q_a_norm\nRMSNorm", f"[{cfg.n_lora_q}]", ATT_BOX),
           ("attn_q_b, Q8_0\nhead RMSNorm", f"[{nh} × {hd}]", ATT_BOX),
           (rope, f"[{nh} × {hd}]", ATT_ROPE),
           ("attention over\nrows, with sink", f"[{nh} × {hd}]", ATT_ATTN),
           ("inverse RoPE\n(query's pos)", f"[{nh} × {hd}]", ATT_ROPE),
           (f"attn_output_a\n{G} groups of {nh // G}", f"[{G} × {cfg.n_lora_o}]",
            ATT_BOX),
           ("attn_output_b\nQ8_0", f"[{cfg.n_embd}]", ATT_BOX)]
    kv = [("attn_kv\nQ8_0", f"[{hd}]", ATT_BOX),
          ("attn_kv_a_norm\nRMSNorm", f"[{hd}]", ATT_BOX),
          (rope, f"[{hd}]", ATT_ROPE),
          (f"E4M3 on dims\n0..{hd - tail - 1}, F16", f"[{hd}]", ATT_BOX)]
    w, step, x0 = 10.6, 12.0, 13.5
    ax.text(1, 20, f"a\n[{cfg.n_embd}]", ha="center", va="center", fontsize=9,
            weight="bold")
    for row, y in ((top, 20), (kv, 8)):
        for i, (text, shape, color) in enumerate(row):
            att_box(ax, x0 + i * step, y, w, f"{text}\n→ {shape}", color, h=6.4)
            if i:
                x1 = x0 + i * step - w / 2
                att_arrow(ax, (x1 - step + w, y), (x1, y))
    att_arrow(ax, (2.6, 20), (x0 - w / 2, 20))
    att_arrow(ax, (2, 18), (x0 - w / 2, 9))
    att_arrow(ax, (x0 + 3 * step + w / 2, 8), (x0 + 4 * step - 1, 16.4))
    ax.text(x0 + 4 * step + 1.5, 8, f"one row [{hd}] per token, the key and the value\n"
            "(the raw window and the compressed rows: ch. 6)", fontsize=8.5,
            va="center")
    ax.set_xlim(-1.5, x0 + 7 * step + w / 2 + 0.5)
    ax.set_ylim(4.3, 23.7)
    ax.axis("off")


def draw_rope_pairs(ax, cfg, gap=36):
    """Which dims RoPE mixes, read off the rotation of the unit vectors at pos 1."""
    hd, n_rot = cfg.head_dim, cfg.n_rot
    first = hd - n_rot
    m = dr.rope_tail(np.eye(hd, dtype=np.float32), 1, cfg, 0)
    mixed = np.argwhere((m != 0) & ~np.eye(hd, dtype=bool))
    pairs = sorted({tuple(sorted(ij)) for ij in mixed.tolist()})
    assert pairs == [(first + 2 * p, first + 2 * p + 1) for p in range(n_rot // 2)]
    ax.add_patch(Rectangle((0, 0), gap, 1, fc="#eeeeee", ec="k", lw=0.7))
    ax.text(gap / 2, 0.5, f"dims 0..{first - 1}\nno position", ha="center",
            va="center", fontsize=8.5)
    ax.text(gap, 0.5, "//", ha="center", va="center", fontsize=11, weight="bold",
            bbox=dict(fc="white", ec="none", pad=0.5))
    x = lambda d: gap + 1 + (d - first)                  # the tail, one unit per dim
    for d in range(first, hd):
        ax.add_patch(Rectangle((x(d), 0), 1, 1, fc=ATT_ROPE, ec="#555555", lw=0.4))
    for p, (i, j) in enumerate(pairs):
        ax.add_patch(FancyArrowPatch((x(i) + 0.5, 1.02), (x(j) + 0.5, 1.02),
                                     arrowstyle="-", lw=0.9,
                                     connectionstyle="arc3,rad=-1.2"))
        if p in (0, n_rot // 4, n_rot // 2 - 1):
            ax.text(x(i) + 1, 1.75, f"p={p}\n{i},{j}", ha="center", fontsize=7.5)
    for d in (first, first + 1, hd - 2, hd - 1):
        ax.text(x(d) + 0.5, -0.15, str(d), ha="center", va="top", fontsize=7,
                rotation=90)
    ax.text(x(first) + n_rot / 2, -1.3, f"the tail, {n_rot} dims: {n_rot // 2} "
            "adjacent pairs (2p, 2p+1), not two halves", ha="center", va="top",
            fontsize=9)
    ax.set_xlim(-1, x(hd) + 1)
    ax.set_ylim(-2.2, 2.8)
    ax.axis("off")


def draw_attention_shapes(cfg):
    fig, (ax0, ax1) = plt.subplots(2, 1, figsize=(11, 5.4),
                                   gridspec_kw={"height_ratios": [1.9, 1]})
    draw_shape_pipeline(ax0, cfg)
    ax0.set_title(f"Attention sub-layer, real shape: {cfg.n_head} query heads of "
                  f"{cfg.head_dim}, one KV row of {cfg.head_dim}", fontsize=10)
    draw_rope_pairs(ax1, cfg)
    ax1.set_title(f"one head [{cfg.head_dim}]: the dims RoPE rotates together "
                  "(rope_tail applied to the unit vectors)", fontsize=9.5)
    plt.tight_layout()
    plt.show()


draw_attention_shapes(ModelConfig.real())

# %% [markdown]
# The whole of one hyper-connection step on the real shape, before the sections below
# take it apart. The four streams feed two paths. Along the top, the control path of
# `hc_pre_from_state_one_scratch` (l. 4356) normalises all 16,384 values together and
# projects them to the 24 numbers of `mix`, which `hc_split_sinkhorn_one` (l. 4258)
# turns into `pre`, `post` and `comb`. Along the middle, `pre` reduces the streams to
# the one vector $x$ that the sub-layer sees. Then `hc_post_one` (l. 4438) writes the
# sub-layer's output $y$ back into every stream with weight `post`, and mixes the old
# streams with `comb`: that is the bottom path, the residual.

# %%
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

from ds4ref.config import ModelConfig

HC_BOX, HC_HIGHLIGHT, HC_PRE, HC_POST, HC_COMB = (
    "#dde8f5", "#f6d5a8", "#9fb7d4", "#f6d5a8", "#d9ead3")


def hc_box(ax, x, y, w, h, text, color=HC_BOX, func=None, fontsize=9):
    """A rounded box centred at (x, y), with the ds4.c function `func` under it."""
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, fc=color, ec="k", lw=0.8,
                                boxstyle="round,pad=0.02,rounding_size=0.6"))
    ax.text(x, y, text, ha="center", va="center", fontsize=fontsize)
    if func:
        ax.text(x, y - h / 2 - 1.0, func, ha="center", va="top", fontsize=7.5,
                family="monospace", color="#555555")


def hc_arrow(ax, p0, p1, text=None, offset=(0, 1.0), rad=0.0, color="k"):
    ax.add_patch(FancyArrowPatch(p0, p1, arrowstyle="-|>", mutation_scale=11, lw=1.0,
                                 color=color, connectionstyle=f"arc3,rad={rad}"))
    if text:
        ax.text((p0[0] + p1[0]) / 2 + offset[0], (p0[1] + p1[1]) / 2 + offset[1], text,
                ha="center", va="bottom", fontsize=8)


def hc_streams(ax, x, y, label, n_hc, left=True):
    """n_hc thin bars, one per stream, centred at (x, y), labelled on one side."""
    for h in range(n_hc):
        yy = y + 2.2 * (n_hc / 2 - h) - 1.6
        ax.add_patch(Rectangle((x - 5, yy), 10, 1.4, fc=HC_BOX, ec="k", lw=0.7))
        ax.text(x - 5.6 if left else x + 5.6, yy + 0.7, f"{label}{'₀₁₂₃₄₅₆₇'[h]}",
                ha="right" if left else "left", va="center", fontsize=9)


def hc_cells(ax, x, y, colors, labels, w=0.9):
    """A row of small cells centred at (x, y), with labels above some of them."""
    x0 = x - len(colors) * w / 2
    for i, c in enumerate(colors):
        ax.add_patch(Rectangle((x0 + i * w, y - 0.6), w, 1.2, fc=c, ec="k", lw=0.5))
    for i, text in labels:
        ax.text(x0 + i * w, y + 0.9, text, ha="left", va="bottom", fontsize=7.5)


def draw_hc_dataflow(cfg):
    n_hc, n = cfg.n_hc, cfg.n_embd
    n_mix = 2 * n_hc + n_hc * n_hc
    fig, ax = plt.subplots(figsize=(11, 5.2))
    hc_streams(ax, 8, 24, "X", n_hc)
    ax.text(7, 28.6, f"the HC state\nX [{n_hc} × {n}]", ha="center", va="bottom",
            fontsize=9)

    # control path: flat RMSNorm -> F16 matvec -> mix -> split
    hc_box(ax, 27, 40, 17, 4.4, f"flatten [{n_hc * n}]\nRMSNorm, no weight",
           func="rms_norm_no_weight")
    hc_box(ax, 46.5, 40, 17, 4.4, f"hc_fn · (F16 matvec)\n[{n_mix} × {n_hc * n}]",
           func="matvec_f16")
    hc_cells(ax, 65, 40, [HC_PRE] * n_hc + [HC_POST] * n_hc + [HC_COMB] * n_hc ** 2,
             [(0, "pre"), (n_hc, "post"), (2 * n_hc, "comb (4 × 4)")], w=0.72)
    ax.text(65, 38.4, f"mix [{n_mix}]", ha="center", va="top", fontsize=9)
    hc_box(ax, 88, 40, 19, 6, "pre = σ(mix·s₀ + B) + ε\npost = 2σ(mix·s₁ + B)\n"
           f"comb: Sinkhorn, {cfg.hc_sinkhorn_iter} passes", color=HC_HIGHLIGHT,
           func="hc_split_sinkhorn_one", fontsize=8.5)
    hc_arrow(ax, (13.5, 27.2), (20, 37.6))
    hc_arrow(ax, (35.7, 40), (37.8, 40))
    hc_arrow(ax, (55.2, 40), (56.2, 40))
    hc_arrow(ax, (73.8, 40), (78.3, 40))

    # main path: weighted sum -> sub-layer -> HC post
    hc_box(ax, 29, 24, 15, 4.4, f"x = Σₕ preₕ Xₕ\n[{n}]", func="hc_weighted_sum_one")
    hc_box(ax, 52.5, 24, 22, 6, "the sub-layer:\nattn_norm → attention (ch. 5-6),\n"
           "or ffn_norm → MoE (ch. 7)", color=HC_HIGHLIGHT, fontsize=8.5)
    hc_box(ax, 76.5, 24, 18, 4.4, "X′_d = post_d · y\n+ Σₛ comb[s, d] · Xₛ",
           func="hc_post_one")
    hc_streams(ax, 94, 24, "X′", n_hc, left=False)
    ax.text(95, 28.6, f"to the next sub-layer\nX′ [{n_hc} × {n}]", ha="center",
            va="bottom", fontsize=9)
    hc_arrow(ax, (13.5, 24), (21.2, 24))
    hc_arrow(ax, (36.8, 24), (41.2, 24), "x")
    hc_arrow(ax, (63.8, 24), (67.2, 24), "y")
    hc_arrow(ax, (85.8, 24), (88.6, 24))
    hc_arrow(ax, (81, 36.8), (32, 26.6), f"pre [{n_hc}]", offset=(-6, -0.4), rad=0.1,
             color="#3f6b9a")
    hc_arrow(ax, (90, 36.8), (79, 26.6), f"post [{n_hc}], comb [{n_hc} × {n_hc}]",
             offset=(8.5, 0.2), color="#a8661c")

    # residual path: the old streams go straight to HC post
    ax.plot([8, 8, 76.5], [19.3, 14.5, 14.5], color="k", lw=1.0)
    hc_arrow(ax, (76.5, 14.5), (76.5, 21.7))
    ax.text(40, 14.1, "X itself: the residual streams, mixed by comb", ha="center",
            va="top", fontsize=8.5)
    ax.set_xlim(0, 104)
    ax.set_ylim(12, 45)
    ax.axis("off")
    ax.set_title("One HC step around a sub-layer (hc_pre, the sub-layer, hc_post), "
                 "real shape", fontsize=10)
    plt.tight_layout()
    plt.show()


draw_hc_dataflow(ModelConfig.real())

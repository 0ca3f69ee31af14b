# %% [markdown]
# Where `layer_ffn_one` (l. 5659) rounds, for one token. Red-edged boxes are the four
# places where a float32 vector becomes int8. Two are Q8_K, 256 values a scale plus the
# `bsums`, from `ds4_quantize_row_q8_K` (l. 1729): the routed experts' input, and their
# weighted `mid`. Two are Q8_0, 32 values a scale, from `quantize_q8_0_activation`
# (l. 3195): the shared expert's input, and its `mid`. Green boxes are integer dot
# products against the stored weights; they add no rounding of their own. Blue boxes run
# in float32. The router reads $f$ unrounded through its F16 weights. The routing weight
# $w_i$ is applied before rounding ③, inside `matvec_iq2_xxs_experts_mid_prequant`
# (l. 3917), so it is rounded along with `mid`.

# %%
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch

from ds4ref.config import ModelConfig

FFN_FLOAT, FFN_INT, FFN_ROUND, FFN_EDGE = "#dde8f5", "#d9ead3", "#f6d5a8", "#b03a2e"


def ffn_box(ax, x, y, w, h, text, kind="float", func=None):
    """A box of one kind: float (float32 op), int (integer dot), round (to int8)."""
    color = {"float": FFN_FLOAT, "int": FFN_INT, "round": FFN_ROUND}[kind]
    edge, lw = (FFN_EDGE, 1.8) if kind == "round" else ("k", 0.8)
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, fc=color, ec=edge,
                                lw=lw, boxstyle="round,pad=0.02,rounding_size=0.5"))
    ax.text(x, y, text, ha="center", va="center", fontsize=8.2)
    if func:
        ax.text(x, y - h / 2 - 0.5, func, ha="center", va="top", fontsize=7,
                family="monospace", color="#555555")


def ffn_arrow(ax, p0, p1, text=None, dx=0.0, dy=0.5, rad=0.0):
    ax.add_patch(FancyArrowPatch(p0, p1, arrowstyle="-|>", mutation_scale=10, lw=0.9,
                                 connectionstyle=f"arc3,rad={rad}"))
    if text:
        ax.text((p0[0] + p1[0]) / 2 + dx, (p0[1] + p1[1]) / 2 + dy, text, ha="center",
                va="bottom", fontsize=8)


def ffn_row(ax, y, boxes, x_in):
    """Boxes (x, w, text, kind, func) in a row at y, chained by arrows from x_in."""
    prev = x_in
    for x, w, text, kind, func in boxes:
        ffn_arrow(ax, (prev, y), (x - w / 2, y))
        ffn_box(ax, x, y, w, 6.2, text, kind, func)
        prev = x + w / 2
    return prev


def draw_ffn_rounding(cfg):
    n, ff, k = cfg.n_embd, cfg.n_ff_exp, cfg.n_expert_used
    c = cfg.swiglu_clamp
    clamp = f"clamp g ≤ {c:g},\n|u| ≤ {c:g};\nsilu(g) · u"
    fig, ax = plt.subplots(figsize=(11, 6.4))
    ffn_box(ax, 5, 21, 8, 6.2, f"X [{cfg.n_hc} × {n}]\nhc_pre\n→ x [{n}]",
            func="hc_pre_from_\nstate_one")
    ffn_box(ax, 15.5, 21, 9, 6.2, f"ffn_norm\nRMSNorm\n→ f [{n}]",
            func="rms_norm_weight")
    ffn_arrow(ax, (9, 21), (11, 21))
    q8k, q8_0 = "ds4_quantize_row_q8_K", "quantize_q8_0_activation"
    routed = [(27, 8.5, "① Q8_K\nint8 × 256\n+ bsums", "round", q8k),
              (39.5, 11, f"gate, up:\nIQ2_XXS weights\n(int dot) → [{ff}]", "int",
               None),
              (53.5, 12, clamp + " · wᵢ", "float", None),
              (66, 8.5, "③ Q8_K\nint8 × 256\n+ bsums", "round", q8k),
              (78, 10, f"down:\nQ2_K weights\n(int dot) → [{n}]", "int", None),
              (90, 9, f"Σ over the\n{k} experts\n(float32)", "float", None)]
    shared = [(27, 8.5, "② Q8_0\nint8 × 32", "round", q8_0),
              (39.5, 11, f"gate, up:\nQ8_0 weights\n(int dot) → [{ff}]", "int", None),
              (53.5, 12, clamp, "float", "swiglu"),
              (66, 8.5, "④ Q8_0\nint8 × 32", "round", "(inside matvec_q8_0)"),
              (78, 10, f"down:\nQ8_0 weights\n(int dot) → [{n}]", "int", None)]
    ffn_row(ax, 21, routed, 20)
    ffn_row(ax, 7, shared, 21.5)
    ax.plot([20, 21.5, 21.5], [21, 21, 7], color="k", lw=0.9)
    ax.plot([21.5, 21.5], [21, 34], color="k", lw=0.9)
    ax.text(23.5, 25.0, f"routed: each of the {k} selected experts (of {cfg.n_expert})",
            ha="left", fontsize=8.5, style="italic")
    ax.text(23.5, 11.0, "shared: one expert, every token", ha="left", fontsize=8.5,
            style="italic")

    # the router reads f in float, through F16 weights
    ffn_box(ax, 33, 34, 13, 6.2, "router: ffn_gate_inp\nF16 weights, f in float\n"
            "(no rounding)", func="layer_router_probs_one")
    ffn_box(ax, 53.5, 34, 18, 6.2, f"p = √softplus; top-{k} of p + bias\n"
            f"(by token id in layers 0-{cfg.n_hash_layer - 1});\n"
            f"wᵢ = {cfg.expert_weights_scale:g} · p / Σ p",
            func="layer_topk_selected_experts")
    ffn_arrow(ax, (21.5, 34), (26.5, 34))
    ffn_arrow(ax, (39.5, 34), (44.5, 34))
    ffn_arrow(ax, (53.5, 30.9), (53.5, 24.1), f"wᵢ and the {k} expert ids", dx=8, dy=0)

    # the sum and hc_post
    ffn_box(ax, 98, 14, 8.5, 6.2, "y = routed\n+ shared\n→ hc_post", "float")
    ffn_arrow(ax, (94.5, 21), (97, 17.1))
    ffn_arrow(ax, (83, 7), (97, 10.9))
    handles = [Patch(fc=FFN_ROUND, ec=FFN_EDGE, lw=1.8,
                     label="rounding: float32 → int8"),
               Patch(fc=FFN_INT, ec="k",
                     label="integer dot with stored weights (exact int32, × scales)"),
               Patch(fc=FFN_FLOAT, ec="k", label="float32")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.02),
              ncol=3, fontsize=8.5, frameon=False)
    ax.set_xlim(0, 103)
    ax.set_ylim(2, 38.5)
    ax.axis("off")
    ax.set_title("The FFN sub-layer of ds4.c, decode (layer_ffn_one): where it rounds",
                 fontsize=10)
    plt.tight_layout()
    plt.show()


draw_ffn_rounding(ModelConfig.real())

# %% [markdown]
# One decode token's path through the engine, on the real shape. `Session.eval` (ds4.c
# `ds4_session_eval`, l. 17779) checks the token and the context, then calls
# `forward_token` (`forward_token_raw_swa_cpu_decode_scratch`, l. 7703). The top row
# turns the token id into the four-stream state. The box on the right runs 43 times,
# once per layer (`layer_forward_raw_swa_one`, l. 7527), and only its attention half
# touches the KV cache: it appends this token's rows and reads the window, the
# compressed rows and the indexer's choice. The bottom row, right to left, is the output
# head (`output_logits_one`, l. 8036). Sampling the logits gives the next token, and
# the next `eval` runs at position + 1.

# %%
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

from ds4ref.config import ModelConfig

ENG_BOX, ENG_LAYER, ENG_CACHE, ENG_FRAME = "#dde8f5", "#f6d5a8", "#d9ead3", "#fbf3e6"


def eng_box(ax, x, y, w, h, text, color=ENG_BOX, func=None, fontsize=8.5):
    """A box centred at (x, y); `func` (the ds4.c function it mirrors) under it."""
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, fc=color, ec="k", lw=0.8,
                                boxstyle="round,pad=0.02,rounding_size=0.5"))
    ax.text(x, y, text, ha="center", va="center", fontsize=fontsize)
    if func:
        ax.text(x, y - h / 2 - 0.5, func, ha="center", va="top", fontsize=7,
                family="monospace", color="#555555")


def eng_arrow(ax, p0, p1, text=None, dx=0.0, dy=0.4, style="-|>", rad=0.0):
    ax.add_patch(FancyArrowPatch(p0, p1, arrowstyle=style, mutation_scale=10, lw=0.9,
                                 connectionstyle=f"arc3,rad={rad}"))
    if text:
        ax.text((p0[0] + p1[0]) / 2 + dx, (p0[1] + p1[1]) / 2 + dy, text,
                ha="center", va="bottom", fontsize=8)


def draw_layer_loop(ax, cfg):
    """The 43 layers: attention sub-layer (with the cache) and FFN sub-layer."""
    ax.add_patch(FancyBboxPatch((50, 13.8), 51, 27, fc=ENG_FRAME, ec="#a8661c", lw=1.2,
                                boxstyle="round,pad=0.02,rounding_size=1.0", zorder=0))
    ax.text(51.5, 39.6, f"× {cfg.n_layer} layers, il = 0..{cfg.n_layer - 1}",
            ha="left", fontsize=9.5, weight="bold")
    eng_box(ax, 63, 30.5, 21, 8, "attention sub-layer\nhc_pre → Q, KV → RoPE\n"
            "→ sink attention → grouped out\n→ hc_post (ch. 5-6)", ENG_LAYER,
            func="layer_attention_one", fontsize=8)
    eng_box(ax, 89, 30.5, 19, 8, "FFN sub-layer\nhc_pre → router → 6 experts\n"
            "+ shared → hc_post (ch. 7)", ENG_LAYER, func="layer_ffn_one", fontsize=8)
    eng_arrow(ax, (73.5, 30.5), (79.5, 30.5), f"X [{cfg.n_hc}×{cfg.n_embd}]", dy=0.5)
    eng_arrow(ax, (89, 34.6), (63, 34.6), rad=0.22)
    ax.text(80, 37.6, "X to the next layer", fontsize=7.5, ha="left", va="bottom")
    eng_box(ax, 63, 19, 24, 5.4, "KV cache of layer il: raw window\n"
            f"({cfg.n_swa} rows), compressed rows,\ncompressor and indexer states",
            ENG_CACHE, func="LayerCache (ds4_layer_cache)", fontsize=7.8)
    eng_arrow(ax, (56, 26.4), (56, 21.8), "push", dx=-2.2, dy=-0.6)
    eng_arrow(ax, (70, 21.8), (70, 26.4), "read", dx=2.2, dy=-0.6)


def draw_decode_path(cfg):
    fig, ax = plt.subplots(figsize=(11, 5.8))
    n = cfg.n_embd
    draw_layer_loop(ax, cfg)
    eng_box(ax, 7, 33, 12.5, 5.4, "Session.eval(token)\nchecks id, ctx",
            func="ds4_session_eval")
    eng_box(ax, 22.5, 33, 11, 5.4, "embed_token\nF16 row → float",
            func="embed_token_f16")
    eng_box(ax, 39, 33, 13, 5.4, "hc_from_plain_\nembedding: 4 copies",
            func="hc_from_plain_embedding")
    eng_arrow(ax, (13.3, 33), (17, 33), "id")
    eng_arrow(ax, (28, 33), (32.5, 33), f"e [{n}]", dy=3.0)
    eng_arrow(ax, (45.5, 32), (52.5, 30.5), f"X [{cfg.n_hc}×{n}]", dx=1.5, dy=3.0)

    # the output head, right to left, and the sampler
    y = 7
    chain = [(89, 15, f"output HC head\nσ weights → [{n}]", "output_hc_head_one"),
             (72.5, 12, "output_norm\nRMSNorm", "rms_norm_weight"),
             (56, 13, f"output (Q8_0)\nint8 x → [{cfg.n_vocab}]", "matvec_q8_0"),
             (39, 13, f"logits [{cfg.n_vocab}]\nkept in the session", "Session.logits"),
             (22, 13, "sample / argmax\ntemperature, top-k/p", "ds4_session_sample")]
    for x, w, text, func in chain:
        eng_box(ax, x, y, w, 5.4, text, func=func)
    for (x0, w0, *_), (x1, w1, *_) in zip(chain, chain[1:]):
        eng_arrow(ax, (x0 - w0 / 2, y), (x1 + w1 / 2, y))
    eng_arrow(ax, (89, 13.6), (89, 9.8), f"X [{cfg.n_hc}×{n}]", dx=4.5, dy=-0.6)
    ax.plot([15.5, 7], [y, y], color="k", lw=0.9)
    eng_arrow(ax, (7, y), (7, 30.2), "next token,\npos + 1", dx=-3.6, dy=-1.5)
    ax.text(31, 20.5, "forward_token:\nfrom embed_token\nto the logits", ha="center",
            va="center", fontsize=8, style="italic", color="#555555")
    ax.set_xlim(0, 104)
    ax.set_ylim(2.5, 41.5)
    ax.axis("off")
    ax.set_title("One decode step: Session.eval → forward_token → logits → the next "
                 "token", fontsize=10)
    plt.tight_layout()
    plt.show()


draw_decode_path(ModelConfig.real())

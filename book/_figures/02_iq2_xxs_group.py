# %% [markdown]
# The group just printed, bit by bit. Its 8 bytes are drawn in memory order, each byte
# with its least significant bit first, so every field reads left to right. The first
# word holds four grid indices $a_l$. The second packs four 7-bit sign indices $s_l$ and
# the scale $S$ in its top four bits. Below, each eight of the group is decoded the way
# `ds4_vec_dot_iq2_xxs_q8_K` (l. 1889) decodes it: `iq2xxs_grid[a_l]` gives the eight
# magnitudes, `ksigns_iq2xs[s_l]` the eight signs (the eighth sign is not stored; it is
# the parity of the seven stored bits), and their product is the int8 vector that meets
# the activation. Every weight of the group shares the factor $d\,(2S+1)/8$.

# %%
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Rectangle

from ds4ref.gguf import GGUFFile
import ds4ref.quant as dq

IQ2_FIELD_COLORS = {"a": "#dde8f5", "s": "#f6d5a8", "S": "#d9ead3"}


def iq2_group_fields(block, group):
    """(name, first bit, n bits, value) of 8-byte group `group` of a 66-byte block."""
    _, grid_idx, sign_idx, scales = dq.unpack_iq2_xxs_indices(block[None])
    a = grid_idx[0, 0, 4 * group:4 * group + 4]
    s = sign_idx[0, 0, 4 * group:4 * group + 4]
    fields = [(f"a{l}", 8 * l, 8, int(a[l])) for l in range(4)]
    fields += [(f"s{l}", 32 + 7 * l, 7, int(s[l])) for l in range(4)]
    return fields + [("S", 60, 4, int(scales[0, 0, group]))]


def draw_cell(ax, x, y, w, text, color, fontsize=8, ls="-"):
    ax.add_patch(Rectangle((x, y), w, 1, fc=color, ec="#555555", lw=0.6, ls=ls))
    ax.text(x + w / 2, y + 0.5, text, ha="center", va="center", fontsize=fontsize)


def draw_bits(ax, group_bytes, fields, y):
    """64 bit cells, byte by byte, least significant bit first, colored by field."""
    bits = np.unpackbits(group_bytes, bitorder="little")
    for name, first, n, value in fields:
        color = IQ2_FIELD_COLORS[name[0]]
        for b in range(first, first + n):
            draw_cell(ax, b, y, 1, str(bits[b]), color, fontsize=7)
        ax.text(first + n / 2, y + 1.25, f"{name} = {value}", ha="center",
                fontsize=8.5)
    for k in range(8):
        ax.text(8 * k + 4, y - 0.45, f"byte {k}: 0x{group_bytes[k]:02x}", ha="center",
                va="center", fontsize=7.5, color="#444444")
        ax.plot([8 * k, 8 * k], [y - 0.15, y + 1.05], color="k", lw=1.6)
    ax.plot([64, 64], [y - 0.15, y + 1.05], color="k", lw=1.6)
    for word, x in (("word 0: four grid indices", 16),
                    ("word 1: 4 × 7 sign bits, then S", 48)):
        ax.text(x, y + 2.2, word, ha="center", fontsize=9.5, weight="bold")


def draw_eights(ax, fields, y):
    """Per eight l: grid magnitudes, signs (parity sign dashed), signed int8 values."""
    a = [v for name, _, _, v in fields if name[0] == "a"]
    s = [v for name, _, _, v in fields if name[0] == "s"]
    for l in range(4):
        x0 = 16 * l
        mags, signs = dq.iq2xxs_grid[a[l]], dq.iq2xxs_signs[s[l]]
        ax.text(x0 + 8, y + 1.3, f"eight l = {l}:  a{l} = {a[l]},  s{l} = {s[l]}",
                ha="center", fontsize=8.5)
        for k in range(8):
            parity = k == 7
            draw_cell(ax, x0 + 2 * k, y, 2, str(mags[k]), IQ2_FIELD_COLORS["a"])
            draw_cell(ax, x0 + 2 * k, y - 1.4, 2, "−" if signs[k] < 0 else "+",
                      "#fdf3e6" if parity else IQ2_FIELD_COLORS["s"], fontsize=10,
                      ls="--" if parity else "-")
            draw_cell(ax, x0 + 2 * k, y - 2.8, 2, str(int(signs[k]) * int(mags[k])),
                      "#ffffff")
        ax.plot([x0, x0], [y - 2.9, y + 1.1], color="k", lw=1.6)
    labels = [(y, "magnitudes g = iq2xxs_grid[a_l]"),
              (y - 1.4, "signs σ = ksigns_iq2xs[s_l]"), (y - 2.8, "σ·g (int8)")]
    for yy, text in labels:
        ax.text(-0.8, yy + 0.5, text, ha="right", va="center", fontsize=8.5)
    ax.text(63, y - 3.35, "dashed: the 8th sign, the parity of the 7 stored bits",
            ha="right", va="center", fontsize=8, color="#444444")


def draw_iq2_xxs_group(path, tensor="blk.0.ffn_gate_exps.weight", group=0):
    g = GGUFFile(path)
    t = g.tensors[tensor]
    block = np.array(t.data[:66])                 # row 0, block 0: f16 d, then 8 groups
    d = float(block[:2].view(np.float16)[0])
    group_bytes = block[2 + 8 * group:10 + 8 * group]
    fields = iq2_group_fields(block, group)
    S = fields[-1][3]
    w = dq.dequantize(block[None], t.ggml_type).reshape(-1)[32 * group:32 * group + 32]
    pairs = zip(fields[:4], fields[4:8])
    signed = np.concatenate([dq.iq2xxs_signs[fs[3]] * dq.iq2xxs_grid[fa[3]].astype(int)
                             for fa, fs in pairs])
    assert np.allclose(w, np.float32(d) * (2 * S + 1) / 8 * signed, rtol=1e-6)

    fig, ax = plt.subplots(figsize=(11, 4.8))
    draw_bits(ax, group_bytes, fields, y=8)
    draw_eights(ax, fields, y=4.2)
    ax.text(32, 0.1, f"w = d · (2S+1)/8 · σ·g  with  d = {d:.6g} (f16, per 256),  "
            f"S = {S}: (2S+1)/8 = {2 * S + 1}/8;   e.g. w[0] = {w[0]:.6g}",
            ha="center", fontsize=9.5)
    ax.text(-0.8, 8.5, "bits, least significant first", ha="right", va="center",
            fontsize=8.5)
    ax.set_xlim(-14, 64.5)
    ax.set_ylim(-0.3, 10.6)
    ax.axis("off")
    ax.set_title(f"{tensor}, row 0, block 0, group {group}: 8 bytes = 32 weights",
                 fontsize=10)
    g.close()
    plt.tight_layout()
    plt.show()


draw_iq2_xxs_group(Path("../data/oracle/dev_seed1.gguf"))

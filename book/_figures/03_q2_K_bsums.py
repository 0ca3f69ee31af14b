# %% [markdown]
# One block of `ds4_vec_dot_q2_K_q8_K` (l. 1769) with real numbers: row 0 of layer 2's
# down projection for the first expert that position 67 of case A selects, against the
# Q8_K activation that ds4.c recorded for it. Each row of the picture is one group $g$
# of 16 weights. Left: the 2-bit codes $q_e$. Middle: the int8 activation $q^y_e$.
# Right, per group: the 4-bit scale $s_g$ times the integer dot $\sum_e q_e q^y_e$, and
# the 4-bit min $m_g$ times `bsums[g]`, the sum of that row of $q^y$, which the
# activation carries. The min term never touches the 256 codes: it is 16
# multiply-adds of $m_g$ with `bsums`.

# %%
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

import ds4ref.matvec as dm
import ds4ref.quant as dq
from ds4ref.weights import load_model


def q2_K_block_parts(path, ops_path, il=2, pos=67, slot=0):
    """One Q2_K block (row 0 of an expert's down projection) and ds4.c's Q8_K input."""
    _, _, w = load_model(path)
    ops = np.load(ops_path)
    key = f"L{il}.P{pos}."
    expert = int(ops[key + "exp_ids"][slot])
    weight = w.layers[il].ffn_down_exps.expert(expert)
    fields = ("qs", "d", "bsums")
    act = dq.Q8KAct(*(ops[f"{key}q8k.ffn_down_exps.{f}"][slot] for f in fields))
    sc, m, q, d, dmin = dq.unpack_q2_K(weight.data[:1])   # row 0: its only block
    return dict(expert=expert, sc=sc[0, 0].astype(int), m=m[0, 0].astype(int),
                q=q[0, 0].reshape(16, 16), d=float(d[0, 0]), dmin=float(dmin[0, 0]),
                qy=act.qs[:256].reshape(16, 16).astype(int), dy=float(act.d[0]),
                bsums=act.bsums[:16].astype(int),
                row0=dm.matvec_q2_K_q8_K(weight, act)[0],
                ds4c=float(ops[key + "exp_down"][slot][0]))


def draw_grid(ax, values, cmap, vmin, vmax, title, numbers):
    ax.imshow(values, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto")
    if numbers:
        for (i, j), v in np.ndenumerate(values):
            ax.text(j, i, str(v), ha="center", va="center", fontsize=7)
    ax.set_xticks([0, 15], ["0", "15"], fontsize=8)
    ax.set_yticks(range(16), [f"g={g}" for g in range(16)], fontsize=8)
    ax.set_xlabel("element in the group", fontsize=8.5)
    ax.set_title(title, fontsize=9.5)


def draw_group_table(ax, p):
    """Per group: s_g, dot_g, s_g*dot_g | m_g, bsums_g, m_g*bsums_g, and the totals."""
    dot = (p["q"] * p["qy"]).sum(1)
    assert np.array_equal(p["bsums"], p["qy"].sum(1))     # bsums = sums of 16 int8s
    cols = [("s_g\n(4 bits)", p["sc"]), ("Σ q·qʸ\n(int)", dot),
            ("s_g·Σ q·qʸ", p["sc"] * dot), ("m_g\n(4 bits)", p["m"]),
            ("bsums_g\n= Σ qʸ", p["bsums"]), ("m_g·bsums", p["m"] * p["bsums"])]
    xs = [0, 1.1, 2.4, 3.9, 5.1, 6.4]
    for x, (name, v), c in zip(xs, cols, range(6)):
        shade = "#dde8f5" if c < 3 else "#f6d5a8"
        ax.text(x, -0.8, name, ha="center", va="bottom", fontsize=8.5, weight="bold")
        for g in range(16):
            ax.text(x, g, str(v[g]), ha="center", va="center", fontsize=8,
                    bbox=dict(boxstyle="square,pad=0.15", fc=shade, ec="none")
                    if c in (2, 5) else None)
    isum, summs = int((p["sc"] * dot).sum()), int((p["m"] * p["bsums"]).sum())
    for x, text in ((xs[2], f"isum = {isum}"), (xs[5], f"summs = {summs}")):
        ax.plot([x - 0.45, x + 0.45], [15.6, 15.6], color="k", lw=0.8, clip_on=False)
        ax.text(x + 0.5, 16.2, text, ha="right", va="top", fontsize=9, weight="bold")
    ax.set_xlim(-0.5, 7.1)
    ax.set_ylim(15.5, -0.5)                       # rows aligned with the grids
    ax.axis("off")
    return isum, summs


def draw_q2_K_bsums(path, ops_path):
    p = q2_K_block_parts(path, ops_path)
    fig = plt.figure(figsize=(11, 6.6))
    grid = fig.add_gridspec(2, 3, width_ratios=[1, 1.1, 1.55], height_ratios=[1, 0.14],
                            wspace=0.18, hspace=0.32, left=0.06, right=0.98, top=0.88,
                            bottom=0.02)
    draw_grid(fig.add_subplot(grid[0, 0]), p["q"], "Blues", -0.5, 6,
              "weight codes q_e (2 bits)", True)
    ax = fig.add_subplot(grid[0, 1])
    draw_grid(ax, p["qy"], "RdBu_r", -127, 127, "activation qʸ_e (int8)", False)
    ax.set_yticks([])
    bar = fig.colorbar(ax.images[0], ax=ax, fraction=0.05, pad=0.02)
    bar.ax.tick_params(labelsize=8)
    isum, summs = draw_group_table(fig.add_subplot(grid[0, 2]), p)
    ax = fig.add_subplot(grid[1, :])
    ax.axis("off")
    value = p["dy"] * p["d"] * isum - p["dy"] * p["dmin"] * summs
    ax.text(0.5, 0.75, f"y₀ = dʸ·d·isum − dʸ·d_min·summs = {p['dy']:.6g}·{p['d']:.6g}·"
            f"({isum}) − {p['dy']:.6g}·{p['dmin']:.6g}·({summs}) = {value:.6g}",
            ha="center", fontsize=10)
    ax.text(0.5, 0.05, f"matvec_q2_K_q8_K row 0: {p['row0']:.6g};   ds4.c's exp_down "
            f"row 0: {p['ds4c']:.6g}   (weights w_e = d·s_g·q_e − d_min·m_g)",
            ha="center", fontsize=9, color="#444444")
    fig.suptitle(f"Q2_K × Q8_K, one 256-value block: blk.2.ffn_down_exps expert "
                 f"{p['expert']}, row 0 · Q8_K of its mid at L2, pos 67", fontsize=10.5)
    plt.show()


draw_q2_K_bsums(Path("../data/oracle/dev_seed1.gguf"), Path("../data/oracle/ops_A.npz"))

# %% [markdown]
# The same file as a strip of bytes, drawn to scale, in the order `model_open`
# (l. 1196) reads it: `parse_metadata` (l. 1113) walks the key/value pairs and
# `parse_tensors` (l. 1143) the directory. The top row is the whole file. Its tables
# take 0.27 % of it, too thin to see, so the second row magnifies them: the
# tokenizer's keys are most of the metadata. The third row shows the first 73 bytes
# field by field, with the values decoded from the file. The last row shows the two
# kinds of padding: after the directory, up to the 32-byte alignment, and after a
# 12-byte tensor, so that the next tensor's offset is again a multiple of 32.

# %%
import struct
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.patches import ConnectionPatch, Rectangle

import ds4ref.gguf as dg

GGUF_TYPE_COLORS = {"F16": "#dde8f5", "F32": "#e6d9f0", "Q8_0": "#f6d5a8",
                    "IQ2_XXS": "#d9ead3", "Q2_K": "#f4cccc", "I32": "#fff2cc"}
GGUF_TABLE_COLORS = {"header": "#9fb7d4", "metadata": "#cfd8e3", "directory": "#b9c7b0",
                     "padding": "#ffffff"}


def gguf_value_nbytes(value, types) -> int:
    """Bytes a metadata value takes in the file, from its decoded value and types."""
    vt = types[0]
    if vt == dg.GGUFValueType.STRING:
        return 8 + len(value.encode())
    if vt == dg.GGUFValueType.ARRAY:                 # item type u32, count u64, items
        return 12 + sum(gguf_value_nbytes(v, types[1:]) for v in value)
    V = dg.GGUFValueType
    return {V.UINT8: 1, V.INT8: 1, V.BOOL: 1, V.UINT16: 2, V.INT16: 2, V.UINT64: 8,
            V.INT64: 8, V.FLOAT64: 8}.get(vt, 4)


def gguf_regions(g):
    """(start, end, kind, name) of the header, each metadata pair, each tensor entry."""
    out, pos = [(0, 24, "header", "header")], 24
    for key, value in g.metadata.items():
        n = 8 + len(key.encode()) + 4 + gguf_value_nbytes(value, g.metadata_types[key])
        out.append((pos, pos + n, "metadata", key))
        pos += n
    for t in g.tensors.values():                        # directory order
        n = 8 + len(t.name.encode()) + 4 + 8 * len(t.shape) + 4 + 8
        out.append((pos, pos + n, "directory", t.name))
        pos += n
    assert pos == g.header_nbytes, (pos, g.header_nbytes)
    out.append((pos, g.data_offset, "padding", "padding"))
    return out


def draw_span(ax, lo, hi, segments, label_min=0.06, fontsize=8):
    """Boxes for (start, end, color, label) segments in [lo, hi), labelled if wide."""
    for s, e, color, label in segments:
        s, e = max(s, lo), min(e, hi)
        if e <= s:
            continue
        ax.add_patch(Rectangle((s, 0), e - s, 1, fc=color, ec="#555555", lw=0.5))
        if label and (e - s) / (hi - lo) >= label_min:
            ax.text((s + e) / 2, 0.5, label, ha="center", va="center",
                    fontsize=fontsize)
    ax.set_xlim(lo, hi)
    ax.set_ylim(0, 1)
    ax.set_yticks([])


def tensor_segments(tensors):
    return [(t.offset, t.offset + t.nbytes, GGUF_TYPE_COLORS[t.ggml_type.name], "")
            for t in tensors]


def draw_whole_file(ax, g, tensors):
    """Row 1: each tensor, colored by type; brackets for token_embd, blk.N, output_*."""
    tables = [(0, g.data_offset, "#9fb7d4", "")]
    draw_span(ax, 0, g.size, tables + tensor_segments(tensors))
    groups = {}
    for t in tensors:
        name = ".".join(t.name.split(".")[:2]) if t.name.startswith("blk.") else t.name
        name = "output_*" if name.startswith("output") else name.removesuffix(".weight")
        groups[name] = (groups.get(name, (t.offset,))[0], t.offset + t.nbytes)
    for name, (s, e) in groups.items():
        ax.annotate("", xy=(s, -0.12), xytext=(e, -0.12), annotation_clip=False,
                    arrowprops=dict(arrowstyle="|-|,widthA=0.3,widthB=0.3", lw=0.8))
        ax.text((s + e) / 2, -0.3, name, ha="center", va="top", fontsize=8)
    ticks = range(0, g.size + 1, 2_000_000)
    ax.set_xticks(list(ticks), [f"{x / 1e6:.0f}" for x in ticks])
    ax.set_xlabel("byte offset (MB)", labelpad=16)
    ax.set_title(f"dev_seed1.gguf: {g.size:,} bytes, {len(tensors)} tensors, alignment "
                 f"{g.alignment}", fontsize=10, loc="left")
    handles = [Rectangle((0, 0), 1, 1, fc=c, ec="#555555", lw=0.5)
               for c in GGUF_TYPE_COLORS.values()]
    ax.legend(handles, list(GGUF_TYPE_COLORS), ncol=6, fontsize=8, frameon=False,
              loc="lower right", bbox_to_anchor=(1, 0.98))


def draw_tables(ax, g, regions, tensors):
    """Row 2: runs of neighbouring metadata keys, the directory, padding, token_embd."""
    big = {f"tokenizer.ggml.{k}" for k in ("tokens", "token_type", "merges")}
    runs = []
    for s, e, kind, name in regions:
        label = name if name in big else kind
        if runs and runs[-1][3] == label and kind != "header":
            runs[-1][1], runs[-1][4] = e, runs[-1][4] + 1
        else:
            runs.append([s, e, kind, label, 1])
    segs, small = [], []
    for s, e, kind, label, n in runs:
        text = (f"tensor directory ({n} entries)" if kind == "directory"
                else label.replace("tokenizer.ggml.token_", "token_") if label in big
                else f"{n} keys" if kind == "metadata" else label)
        if kind == "metadata" and s == 24:
            text += " (general.*, deepseek4.*, …)"
        segs.append((s, e, GGUF_TABLE_COLORS[kind], text if e - s > 3000 else ""))
        if e - s <= 3000:
            small.append(((s + e) / 2, text))
    hi = g.data_offset + 2048
    draw_span(ax, 0, hi, segs + tensor_segments(tensors[:1]), label_min=0.0)
    ax.text(hi - 1024, 0.5, "token_embd", ha="center", va="center", fontsize=8)
    for i, (x, text) in enumerate(small):
        dy = 1.12 + 0.3 * (i % 2)
        ax.annotate(text, xy=(x, 1), xytext=(x, dy), fontsize=8,
                    ha="left" if x < 0.05 * hi else "center",
                    arrowprops=dict(arrowstyle="-", lw=0.6), annotation_clip=False)
    ticks = range(0, hi, 4096)
    ax.set_xticks(list(ticks), [f"{x // 1024}" for x in ticks])
    ax.set_xlabel("byte offset (KiB)")
    return hi


def draw_header_fields(ax, g, path, regions):
    """Row 3: the header and the first key/value pair, field by field, from the file."""
    raw = Path(path).read_bytes()[:regions[1][1]]
    klen = struct.unpack_from("<Q", raw, 24)[0]
    vt = 32 + klen                        # value type, then the string value
    vlen = struct.unpack_from("<Q", raw, vt + 4)[0]
    u32 = lambda at: struct.unpack_from("<I", raw, at)[0]
    u64 = lambda at: struct.unpack_from("<Q", raw, at)[0]
    fields = [(0, 4, "header", "magic", raw[:4].decode()),
              (4, 8, "header", "version", u32(4)),
              (8, 16, "header", "tensor count", u64(8)),
              (16, 24, "header", "metadata count", u64(16)),
              (24, 32, "metadata", "key length", klen),
              (32, vt, "metadata", "key", raw[32:vt].decode()),
              (vt, vt + 4, "metadata", "type", dg.GGUFValueType(u32(vt)).name),
              (vt + 4, vt + 12, "metadata", "length", vlen),
              (vt + 12, vt + 12 + vlen, "metadata", "value", raw[vt + 12:].decode())]
    assert vt + 12 + vlen == regions[1][1]
    segs = [(s, e, GGUF_TABLE_COLORS[k], name) for s, e, k, name, _ in fields]
    draw_span(ax, 0, regions[1][1], segs, label_min=0.0, fontsize=7.5)
    for s, e, _, _, value in fields:
        ax.text((s + e) / 2, 1.12, str(value), ha="center", va="bottom", fontsize=8,
                family="monospace")
    edges = sorted({f[0] for f in fields} | {fields[-1][1]})
    ax.set_xticks(edges, [str(x) for x in edges], fontsize=8)
    ax.set_xlabel("byte offset (B); decoded value above each field")


def draw_padding(ax, segs, lo, hi, title):
    """Row 4: one zoom on a padding, ticks at the segment edges."""
    draw_span(ax, lo, hi, segs, label_min=0.08)
    edges = sorted({s for s, *_ in segs[1:]} | {e for _, e, *_ in segs[:-1]})
    ax.set_xticks(edges, [f"{x:,}" for x in edges], fontsize=8)
    ax.set_title(title, fontsize=9)


def draw_gguf_byte_map(path):
    g = dg.GGUFFile(path)
    regions = gguf_regions(g)
    tensors = sorted(g.tensors.values(), key=lambda t: t.offset)
    fig = plt.figure(figsize=(11, 8.2))
    grid = fig.add_gridspec(4, 2, height_ratios=[1, 1, 0.8, 0.8], hspace=1.3,
                            wspace=0.12, left=0.03, right=0.98, top=0.95, bottom=0.06)
    ax1 = fig.add_subplot(grid[0, :])
    draw_whole_file(ax1, g, tensors)
    ax2 = fig.add_subplot(grid[1, :])
    hi = draw_tables(ax2, g, regions, tensors)
    for x in (0, hi):                          # row 2 magnifies row 1's first bytes
        fig.add_artist(ConnectionPatch((x, 0), (x, 1), "data", "data", axesA=ax1,
                                       axesB=ax2, color="#888888", lw=0.8, ls="--"))
    draw_header_fields(fig.add_subplot(grid[2, :]), g, path, regions)

    last = regions[-2]
    d0 = g.data_offset
    tail = [(last[0], last[1], GGUF_TABLE_COLORS["directory"], "last directory entry"),
            (g.header_nbytes, d0, "#ffffff", "pad"),
            (d0, d0 + 64, GGUF_TYPE_COLORS["F16"], "token_embd")]
    draw_padding(fig.add_subplot(grid[3, 0]), tail,
                 g.header_nbytes - 40, d0 + 24,
                 f"end of the directory → data_offset = {d0:,} "
                 f"= {g.alignment} × {d0 // g.alignment:,}")
    i = next(i for i, t in enumerate(tensors) if t.nbytes % g.alignment)
    prev, t, nxt = tensors[i - 1:i + 2]
    f16, f32 = GGUF_TYPE_COLORS["F16"], GGUF_TYPE_COLORS["F32"]
    inside = [(prev.offset, prev.offset + prev.nbytes, f16, "hc_attn_fn"),
              (t.offset, t.offset + t.nbytes, f32, "scale"),
              (t.offset + t.nbytes, nxt.offset, "#ffffff", "pad"),
              (nxt.offset, nxt.offset + nxt.nbytes, f32, "hc_attn_base")]
    draw_padding(fig.add_subplot(grid[3, 1]), inside, t.offset - 24, nxt.offset + 40,
                 f"{t.name}: {t.nbytes} B, then "
                 f"{nxt.offset - t.offset - t.nbytes} B of padding")
    g.close()
    plt.show()


draw_gguf_byte_map(Path("../data/oracle/dev_seed1.gguf"))

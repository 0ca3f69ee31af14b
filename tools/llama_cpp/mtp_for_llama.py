#!/usr/bin/env python3
"""Write ds4's MTP block as llama.cpp's deepseek4 "MTP-only" GGUF (its NextN layout).

    python tools/llama_cpp/mtp_for_llama.py MODEL.gguf MODEL-mtp.gguf OUT.mtp.llama.gguf

llama.cpp 0c1e570 runs DeepSeek V4's MTP block as an appended layer: block_count = n_layer + 1,
`deepseek4.nextn_predict_layers` = 1, the block's tensors under `blk.{n_layer}.*`, and a file
with no trunk layer (no `blk.0.attn_norm.weight`) loads as MTP-only (llama_model_deepseek4::
load_arch_tensors, src/models/deepseek4.cpp). Its DECODER_MTP graph (graph_mtp, same file) reads:

  blk.L.nextn.eh_proj   [2*n_embd, n_embd]  one matrix over concat(enorm(emb), hnorm(h)):
                        ds4's e_proj and h_proj side by side along the input (Q8_0 rows joined
                        byte-wise: both have n_embd/32 whole blocks per row)
  blk.L.nextn.enorm, blk.L.nextn.hnorm      ds4's mtp.0.enorm / mtp.0.hnorm
  blk.L.nextn.shared_head_norm              ds4's mtp.0.norm (the head's RMS norm)
  output_hc_fn/base/scale                   the HC head: ds4's mtp.0.hc_head_* (in an MTP-only
                                            file the root HC head is the block's, as llama.cpp's
                                            own converter writes it: conversion/deepseek.py,
                                            DeepseekV4Model.filter_tensors)
  token_embd, output, output_norm           the target's (shared embedding and LM head)
  blk.L.<layer tensors>                     ds4's mtp.0.<same name> (attention, HC, MoE)

Per-layer arrays (compress_ratios, swiglu_clamp_exp) get an entry for the block (ratio 0: raw
window only, as ds4.c runs it); `deepseek4.expert_gating_func` = 4 as in gguf_for_llama.py.
Metadata is copied through gguf-py's GGUFReader / GGUFWriter (pinned in requirements.txt).
"""
from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np

from ds4ref.dev.bench_programs import LLAMA_GATING_KEY, LLAMA_SQRT_SOFTPLUS

ARCH = "deepseek4"
NEXTN_KEY = f"{ARCH}.nextn_predict_layers"
RENAMED = {"enorm.weight": "nextn.enorm.weight", "hnorm.weight": "nextn.hnorm.weight",
           "norm.weight": "nextn.shared_head_norm.weight"}
ROOT = {"hc_head_fn.weight": "output_hc_fn.weight", "hc_head_base.weight": "output_hc_base.weight",
        "hc_head_scale.weight": "output_hc_scale.weight"}
FROM_TARGET = ("token_embd.weight", "output.weight", "output_norm.weight")


def _field(reader, key):
    f = reader.get_field(key)
    if f is None:
        raise SystemExit(f"{reader.data.filename}: missing key {key}")
    return f


def _copy_keys(reader, writer, n_layer: int) -> None:
    per_layer = {f"{ARCH}.attention.compress_ratios": 0, f"{ARCH}.swiglu_clamp_exp": None}
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name == gguf.Keys.General.ARCHITECTURE:
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        val = f.contents()
        if f.name == f"{ARCH}.block_count":
            val = n_layer + 1
        elif f.name == gguf.Keys.General.NAME:
            val = f"{val}-mtp-llama"
        elif f.name in per_layer:
            extra = per_layer[f.name]
            val = list(val) + [val[-1] if extra is None else extra]      # the block's entry
        writer.add_key_value(f.name, val, vtype, sub_type=sub)
    writer.add_key_value(NEXTN_KEY, 1, gguf.GGUFValueType.UINT32)
    writer.add_key_value(LLAMA_GATING_KEY, LLAMA_SQRT_SOFTPLUS, gguf.GGUFValueType.UINT32)


def _tensors(main, mtp, n_layer: int):
    """(name, raw array as GGUFReader holds it, GGML type) of every tensor of the output."""
    by_name = {t.name: t for t in main.tensors}
    for name in FROM_TARGET:
        t = by_name[name]
        yield name, t.data, t.tensor_type
    m = {t.name[len("mtp.0."):]: t for t in mtp.tensors}
    e, h = m.pop("e_proj.weight"), m.pop("h_proj.weight")
    if e.tensor_type != gguf.GGMLQuantizationType.Q8_0 or h.tensor_type != e.tensor_type:
        raise SystemExit("mtp.0.e_proj / h_proj: expected Q8_0 (rows are joined byte-wise)")
    yield f"blk.{n_layer}.nextn.eh_proj.weight", np.concatenate([e.data, h.data], 1), e.tensor_type
    for sub, t in m.items():
        name = ROOT.get(sub) or f"blk.{n_layer}.{RENAMED.get(sub, sub)}"
        yield name, t.data, t.tensor_type


def write_mtp_for_llama(main_path, mtp_path, dst) -> Path:
    """Write llama.cpp's MTP-only GGUF of ds4ref's main + MTP GGUF pair to dst."""
    main, mtp = gguf.GGUFReader(str(main_path), "r"), gguf.GGUFReader(str(mtp_path), "r")
    if _field(main, gguf.Keys.General.ARCHITECTURE).contents() != ARCH:
        raise SystemExit(f"{main_path}: not a {ARCH} GGUF")
    n_layer = int(_field(main, f"{ARCH}.block_count").contents())
    writer = gguf.GGUFWriter(str(dst), arch=ARCH, endianess=main.endianess)
    _copy_keys(main, writer, n_layer)
    rows = list(_tensors(main, mtp, n_layer))
    for name, data, kind in rows:
        writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in rows:
        writer.write_tensor_data(np.ascontiguousarray(data), tensor_endianess=main.endianess)
    writer.close()
    return Path(dst)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    out = write_mtp_for_llama(*sys.argv[1:])
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB)")

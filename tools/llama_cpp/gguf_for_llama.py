#!/usr/bin/env python3
"""Copy a ds4 GGUF for llama.cpp: add the one key its deepseek4 loader wants.

    python tools/llama_cpp/gguf_for_llama.py MODEL.gguf MODEL.llama.gguf

llama.cpp 0c1e570 reads the router's gating function from `deepseek4.expert_gating_func`
(4 = sqrt(softplus), LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS); ds4.c fixes that function in code
and its GGUFs do not carry the key. Everything else is copied unchanged, by gguf-py's own
copy_with_new_metadata (the gguf package, pinned in requirements.txt).
"""
from __future__ import annotations

import sys
from pathlib import Path

import gguf
from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

KEY, SQRT_SOFTPLUS = "deepseek4.expert_gating_func", 4


def main(src: str, dst: str) -> None:
    reader = gguf.GGUFReader(src, "r")
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    if arch != "deepseek4":
        raise SystemExit(f"{src}: general.architecture is {arch!r}, not 'deepseek4'")
    writer = gguf.GGUFWriter(dst, arch=arch, endianess=reader.endianess)
    new = {KEY: MetadataDetails(gguf.GGUFValueType.UINT32, SQRT_SOFTPLUS)}
    copy_with_new_metadata(reader, writer, new, [])
    print(f"wrote {dst} ({Path(dst).stat().st_size / 1e9:.3f} GB) with {KEY} = {SQRT_SOFTPLUS}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(*sys.argv[1:])

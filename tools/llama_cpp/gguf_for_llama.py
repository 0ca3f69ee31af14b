#!/usr/bin/env python3
"""Copy a ds4 GGUF for llama.cpp: add the one key its deepseek4 loader wants.

    python tools/llama_cpp/gguf_for_llama.py MODEL.gguf MODEL.llama.gguf

llama.cpp 0c1e570 reads the router's gating function from `deepseek4.expert_gating_func`
(4 = sqrt(softplus), LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS); ds4.c fixes that function in code
and its GGUFs do not carry the key. Everything else is copied unchanged, by gguf-py's own
copy_with_new_metadata (the gguf package, pinned in requirements.txt), in
`ds4ref.dev.bench_programs.write_llama_gguf` (the engine benchmark's `--llama-cpp` writes the same copy).
"""
from __future__ import annotations

import sys
from pathlib import Path

from ds4ref.dev.bench_programs import (
    LLAMA_GATING_KEY,
    LLAMA_SQRT_SOFTPLUS,
    write_llama_gguf,
)


def main(src: str, dst: str) -> None:
    write_llama_gguf(src, dst)
    size = Path(dst).stat().st_size / 1e9
    print(f"wrote {dst} ({size:.3f} GB) with {LLAMA_GATING_KEY} = {LLAMA_SQRT_SOFTPLUS}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(*sys.argv[1:])

"""Write a copy of ds4.c whose fixed shape matches a GGUF (for building tiny/wide oracles locally).

ds4.c names its model shape in one enum (DS4_N_LAYER = 43, ...) and, at commit 8d57664, also hard-codes
the q-LoRA rank 1024, the o-LoRA rank 1024 and the output group count 8 as literals in the CPU path.
This script rewrites the enum values from the GGUF's metadata (read with ds4ref.config) and replaces
those literals with the enum names, the same edit data/oracle/README.md describes. It edits nothing else
and checks that every pattern it relies on was found, so a newer ds4.c fails loudly instead of silently.

    python tools/ds4c/shape_patch.py [--log-experts] [--log-indexer] [--dump-steering] PATH/TO/ds4.c MODEL.gguf OUT.c
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

from ds4ref.config import ModelConfig
from ds4ref.gguf import GGUFFile

ENUM = {  # ds4.c enum name -> ModelConfig field
    "DS4_N_LAYER": "n_layer", "DS4_N_EMBD": "n_embd", "DS4_N_VOCAB": "n_vocab", "DS4_N_HEAD": "n_head",
    "DS4_N_HEAD_KV": "n_head_kv", "DS4_N_HEAD_DIM": "head_dim", "DS4_N_VALUE_DIM": "value_dim",
    "DS4_N_ROT": "n_rot", "DS4_N_OUT_GROUP": "n_out_group", "DS4_N_LORA_Q": "n_lora_q",
    "DS4_N_LORA_O": "n_lora_o", "DS4_N_EXPERT": "n_expert", "DS4_N_EXPERT_USED": "n_expert_used",
    "DS4_N_EXPERT_SHARED": "n_expert_shared", "DS4_N_FF_EXP": "n_ff_exp", "DS4_N_HASH_LAYER": "n_hash_layer",
    "DS4_N_SWA": "n_swa", "DS4_N_INDEXER_HEAD": "n_indexer_head", "DS4_N_INDEXER_HEAD_DIM": "indexer_head_dim",
    "DS4_N_INDEXER_TOP_K": "indexer_top_k", "DS4_N_HC": "n_hc", "DS4_N_HC_SINKHORN_ITER": "hc_sinkhorn_iter",
}

# (regex, replacement, expected number of matches at commit 8d57664)
LITERALS = [
    (r"xmalloc\(1024 \* sizeof", "xmalloc(DS4_N_LORA_Q * sizeof", 6),            # qr / qr_norm buffers
    (r"\(size_t\)n_tok \* 1024 \*", "(size_t)n_tok * DS4_N_LORA_Q *", 2),       # batch qr / qr_norm
    (r"\(uint64_t\)t \* 1024\b", "(uint64_t)t * DS4_N_LORA_Q", 3),             # batch strides
    (r"q_a_norm, 1024, DS4_RMS_EPS", "q_a_norm, DS4_N_LORA_Q, DS4_RMS_EPS", 3),  # q-LoRA RMSNorm length
    (r"(q_a_norm,\n\s+)1024,", r"\1DS4_N_LORA_Q,", 1),                          # the batch RMSNorm call
    (r"const uint32_t rank = 1024;", "const uint32_t rank = DS4_N_LORA_O;", 3),
    (r"const uint32_t n_groups = 8;", "const uint32_t n_groups = DS4_N_OUT_GROUP;", 3),
]


# Optional instrumentation (--log-experts): append every biased top-k expert choice to the file named by
# $DS4C_EXPERT_LOG, in call order: the DS4_N_EXPERT_USED int32 ids, then the DS4_N_EXPERT float32 biased
# scores they were chosen from (for the margins). Nothing else in the computation changes.
EXPERT_SELECT = "topk_desc(selection, DS4_N_EXPERT, DS4_N_EXPERT_USED, selected);"
EXPERT_LOG = (EXPERT_SELECT + " { static FILE *ds4c_log; const char *ds4c_path = getenv(\"DS4C_EXPERT_LOG\");"
              " if (ds4c_path && !ds4c_log) ds4c_log = fopen(ds4c_path, \"wb\");"
              " if (ds4c_log) { fwrite(selected, sizeof(int), DS4_N_EXPERT_USED, ds4c_log);"
              " fwrite(selection, sizeof(float), DS4_N_EXPERT, ds4c_log); fflush(ds4c_log); } }")


# Optional instrumentation (--log-indexer): every indexer selection (n_comp > top_k, both the allocating and
# the decode-scratch function) appends (il u32, pos u32, n_comp u32, top_k u32, the selected rows as top_k u32
# in increasing order) to the file named by $DS4C_INDEXER_LOG (appending: two functions write it; the runner
# deletes it before each run). It reads the selection after it is made.
INDEXER_SELECT = "        allowed[best] = true;\n    }\n"
INDEXER_LOG = (INDEXER_SELECT + "    { static FILE *ds4c_ilog; const char *ds4c_ipath = getenv(\"DS4C_INDEXER_LOG\");"
               " if (ds4c_ipath && !ds4c_ilog) ds4c_ilog = fopen(ds4c_ipath, \"ab\");"
               " if (ds4c_ilog) { uint32_t ds4c_h[4] = {il, pos, n_comp, top_k}; fwrite(ds4c_h, 4, 4, ds4c_ilog);"
               " for (uint32_t c = 0; c < n_comp; c++) if (allowed[c]) fwrite(&c, 4, 1, ds4c_ilog);"
               " fflush(ds4c_ilog); } }\n")


# Optional instrumentation (--dump-steering): every directional-steering call appends (il u32, rows u32,
# scale f32, the rows before [rows, n_embd] f32, the rows after) to the file named by $DS4C_STEER_DUMP.
# The original function is renamed and kept noinline, so its arithmetic is compiled as before (the
# instrumented build's logits equal the plain build's bit for bit; record.py --steering checks it).
STEER_HEAD = """static void cpu_directional_steering_project_rows(
        float       *x,
        const float *dirs,
        uint32_t     il,
        uint32_t     rows,
        float        scale) {
    if (!cpu_directional_steering_enabled(dirs, scale) || !x || rows == 0) return;
"""
STEER_ARGS = "(float *x, const float *dirs, uint32_t il, uint32_t rows, float scale)"
STEER_DUMP = (
    f"static void ds4c_steer_orig{STEER_ARGS};\n"
    f"static void cpu_directional_steering_project_rows{STEER_ARGS} {{\n"
    "    FILE *f = getenv(\"DS4C_STEER_DUMP\") && cpu_directional_steering_enabled(dirs, scale) && x && rows\n"
    "              ? fopen(getenv(\"DS4C_STEER_DUMP\"), \"ab\") : NULL;\n"
    "    if (f) { fwrite(&il, 4, 1, f); fwrite(&rows, 4, 1, f); fwrite(&scale, 4, 1, f);\n"
    "             fwrite(x, 4, (size_t)rows * DS4_N_EMBD, f); }\n"
    "    ds4c_steer_orig(x, dirs, il, rows, scale);\n"
    "    if (f) { fwrite(x, 4, (size_t)rows * DS4_N_EMBD, f); fclose(f); }\n"
    "}\n"
    f"__attribute__((noinline)) static void ds4c_steer_orig{STEER_ARGS} {{\n"
    "    if (!cpu_directional_steering_enabled(dirs, scale) || !x || rows == 0) return;\n")


def patch(src: str, cfg: ModelConfig, log_experts: bool = False, dump_steering: bool = False,
          log_indexer: bool = False) -> str:
    for name, field in ENUM.items():
        src, n = re.subn(rf"(\n\s+{name}\s+= )\d+,", rf"\g<1>{getattr(cfg, field)},", src, count=1)
        if n != 1:
            raise SystemExit(f"shape_patch: enum entry {name} not found; is this ds4.c at commit 8d57664?")
    for pat, rep, want in LITERALS:
        src, n = re.subn(pat, rep, src)
        if n != want:
            raise SystemExit(f"shape_patch: pattern {pat!r} matched {n} times, expected {want}")
    if log_experts:
        if src.count(EXPERT_SELECT) != 1:
            raise SystemExit("shape_patch: the biased top-k expert selection call was not found")
        src = src.replace(EXPERT_SELECT, EXPERT_LOG)
    if log_indexer:
        if src.count(INDEXER_SELECT) != 2:
            raise SystemExit("shape_patch: the two indexer top-k selection loops were not found")
        src = src.replace(INDEXER_SELECT, INDEXER_LOG)
    if dump_steering:
        if src.count(STEER_HEAD) != 1:
            raise SystemExit("shape_patch: the definition of cpu_directional_steering_project_rows was not found")
        src = src.replace(STEER_HEAD, STEER_DUMP)
    return src


def main(argv: list[str]) -> None:
    log_experts, dump_steering = "--log-experts" in argv, "--dump-steering" in argv
    log_indexer = "--log-indexer" in argv
    argv = [a for a in argv if a not in ("--log-experts", "--dump-steering", "--log-indexer")]
    if len(argv) != 3:
        raise SystemExit(__doc__)
    ds4_c, model, out = map(Path, argv)
    with GGUFFile(model) as g:
        cfg = ModelConfig.from_gguf(g)
    out.write_text(patch(ds4_c.read_text(), cfg, log_experts, dump_steering, log_indexer))
    print(f"shape_patch: wrote {out} for n_layer={cfg.n_layer} n_embd={cfg.n_embd} n_vocab={cfg.n_vocab}")


if __name__ == "__main__":
    main(sys.argv[1:])

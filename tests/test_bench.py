"""Appendix E's accounting (no timing): the bytes a decode token reads, by type, against the GGUF file's own tensor
directory; and the label the decode profile charges each seam call to."""
from __future__ import annotations

import numpy as np

from ds4ref.dev.bench_engine import decode_bytes_by_type, decode_bytes_per_token
from ds4ref.dev.profile import call_label
from ds4ref.gguf import GGUFFile
from ds4ref.weights import load_model


def test_decode_bytes_by_type_match_the_files_tensor_directory(oracle_gguf):
    """From the file: every tensor's byte size, n_expert_used / n_expert of an expert tensor, one row of the embedding
    and the hash table (I32 rows of 4-byte ids); tensor_specs is not used."""
    g = GGUFFile(oracle_gguf)
    _, cfg, _ = load_model(oracle_gguf)
    want: dict = {}
    for name, t in g.tensors.items():
        n = int(t.nbytes)
        if "_exps." in name:
            n = n * cfg.n_expert_used // cfg.n_expert
        elif name.startswith("token_embd") or "tid2eid" in name:
            n = n // int(np.prod(t.shape[1:]))
        want[t.ggml_type.name] = want.get(t.ggml_type.name, 0) + n
    got = decode_bytes_by_type(cfg)
    assert got == want
    assert decode_bytes_per_token(cfg) == sum(want.values())


def test_profile_charges_kernels_to_the_weight_type_they_read(model):
    cfg, W = model
    lw = W.layers[cfg.n_hash_layer]                     # a top-k layer
    assert call_label("experts_mid", (lw.ffn_gate_exps,)) == lw.ffn_gate_exps.ggml_type.name == "IQ2_XXS"
    assert call_label("experts_down", (lw.ffn_down_exps,)) == "Q2_K"
    assert call_label("project", (lw.attn_q_a,)) == "Q8_0"
    assert call_label("project", (np.zeros((4, 4), np.float32),)) == "F32"
    assert call_label("attention", ()) == "attention"
    assert call_label("rope", ()) == "glue: rope"
    assert call_label("hc_split_sinkhorn", ()) == "glue: hc_split_sinkhorn"

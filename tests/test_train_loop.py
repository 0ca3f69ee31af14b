"""Appendix B's training loss: what each term's gradient reaches (needs torch)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ds4ref.config import ModelConfig  # noqa: E402
from ds4ref.mtp import mtp_tensor_specs  # noqa: E402
from ds4ref.train.loop import Recipe, losses  # noqa: E402
from ds4ref.train.model import DS4Torch, rope_tables  # noqa: E402

SHARED = {"token_embd.weight", "output.weight"}


@pytest.fixture(scope="module")
def grads() -> dict:
    """{loss term: {GGUF name: max |grad|}} on one short random window."""
    cfg = ModelConfig.tiny()
    model = DS4Torch(cfg, seed=0, mtp_specs=mtp_tensor_specs(cfg))
    T = 9   # 8 inputs: no compressed row is emitted, so no indexer loss
    tabs = {0: rope_tables(cfg, T, 0)}
    tabs[4] = tabs[128] = rope_tables(cfg, T, 4)
    x = torch.from_numpy(np.random.default_rng(0).integers(0, cfg.n_vocab, (1, T)))
    out, _ = losses(model, x, tabs, Recipe())
    names = list(model.names)
    params = [model.p(n) for n in names]
    got = {}
    for term in ("main", "mtp1", "mtp2"):
        g = torch.autograd.grad(out[term], params, retain_graph=True, allow_unused=True)
        got[term] = {n: 0.0 if t is None else float(t.abs().max()) for n, t in zip(names, g)}
    return got


def test_mtp_losses_reach_the_mtp_block_and_the_two_shared_matrices_only(grads):
    """Appendix B.4: the MTP terms train the MTP block and, beside the main loss, the token
    embedding and the output matrix it shares; no main layer (blk.*), HC head or norm."""
    for term in ("mtp1", "mtp2"):
        g = grads[term]
        reached = {n for n, v in g.items() if v > 0}
        assert SHARED <= reached, term
        assert not {n for n in reached - SHARED if not n.startswith("mtp.")}, term
        assert any(n.startswith("mtp.0.h_proj") for n in reached)


def test_main_loss_reaches_no_mtp_tensor(grads):
    """The main next-token loss never reads the MTP block."""
    g = grads["main"]
    assert all(v == 0 for n, v in g.items() if n.startswith("mtp."))
    assert all(g[n] > 0 for n in SHARED)

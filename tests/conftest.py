"""Shared fixtures: the ds4.c oracle data copied into data/oracle (never ../shared)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
ORACLE = ROOT / "data" / "oracle"


@pytest.fixture(scope="session")
def oracle_dir() -> Path:
    return ORACLE


@pytest.fixture(scope="session")
def oracle_gguf() -> Path:
    """The tiny DS4-shaped GGUF that ds4.c ran (dev_seed1.gguf)."""
    return ORACLE / "dev_seed1.gguf"


@pytest.fixture(scope="session")
def ops_A():
    """ds4.c's recorded inputs and outputs of every op (case A, decode path)."""
    return np.load(ORACLE / "ops_A.npz")


@pytest.fixture(scope="session")
def model(oracle_gguf):
    """(ModelConfig, Weights) of the oracle GGUF, loaded once for the whole run."""
    from ds4ref.weights import load_model
    _, cfg, weights = load_model(oracle_gguf)
    return cfg, weights


@pytest.fixture(scope="session")
def positions(ops_A) -> list[int]:
    """The positions ds4.c dumped in ops_A.npz (see data/oracle/README.md for why these)."""
    return [int(p) for p in ops_A["positions"]]


@pytest.fixture(scope="session")
def golden_A():
    return np.load(ORACLE / "golden_A.npz")


@pytest.fixture(scope="session")
def golden_C():
    return np.load(ORACLE / "golden_C.npz")


@pytest.fixture(scope="session")
def golden_json() -> dict:
    return json.loads((ORACLE / "golden.json").read_text())


def _have_cuda_gpu() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def _torch_available() -> bool:
    import importlib.util
    return importlib.util.find_spec("torch") is not None


def pytest_collection_modifyitems(config, items):
    """GPU tests skip without a CUDA GPU; appendix B (training, PyTorch: an optional dependency,
    `pip install -e .[train]`) skips without torch. Each skip says why."""
    gpu = _have_cuda_gpu()
    torch_ok = _torch_available()
    skip_gpu = pytest.mark.skip(reason="no CUDA GPU with CuPy on this machine (GPU tests run on a lent device)")
    skip_torch = pytest.mark.skip(reason="appendix B needs PyTorch: pip install -e .[train]")
    for item in items:
        if not gpu and "gpu" in item.keywords:
            item.add_marker(skip_gpu)
        if not torch_ok and Path(str(item.fspath)).name == "B_training.ipynb":
            item.add_marker(skip_torch)


def have_nvcc() -> bool:
    return shutil.which("nvcc") is not None

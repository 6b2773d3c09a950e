"""Shared test setup: offline Hugging Face, Triton's CPU interpreter when there is no GPU, and one
tiny model per session."""

import os

import pytest
import torch

# Set before any test module is imported: huggingface_hub reads the offline flags when it is first
# imported, and Triton decides interpreter-vs-compiled when a kernel is decorated, not per call.
# Nothing above imports either.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # The tests' models are tiny: with a thread per core, torch's workers spin on every small matmul and the
    # suite runs several times slower on a 2-core box (subprocesses inherit the setting through the environment).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """Default tiny Qwen3 (2 layers, 4 heads, 2 KV heads, head_dim 128), built once per session."""
    from kvstreams_sglang.testing import build_tiny_model  # after the env flags above

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where kernel tests run: the GPU when there is one (compiled Triton), else the CPU
    (Triton's interpreter). The same specifications hold on both."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def _seeded_global_rng():
    """Every test starts from the same global torch RNG state, whatever ran before it: tests that draw
    with ``torch.randn`` (kernel inputs) see the same data in a full run, a ``-k`` subset or alone. (A
    random query can land within ~1e-7 of an INT8 code boundary, where two summation orders of the
    Hadamard rotation disagree by one code; with an order-dependent draw that showed up as a rare flake.)"""
    torch.manual_seed(0)

"""Issue 25's acceptance fuzz, bounded: random sync and async engine ops with injected faults
(pool exhaustion, bad ids, forward exceptions, over-long contexts, invalid evictions, cancelled
waiters) keep the engine's books balanced after every op (``bench.fuzz_engine``; ``python -m
bench.fuzz_engine --ops 100000`` for long runs)."""

import pytest
import torch

from bench.fuzz_engine import build_fuzz_model, fuzz_engine


@pytest.fixture(scope="module")
def fuzz_model(tmp_path_factory):
    return build_fuzz_model(tmp_path_factory.mktemp("fuzz_model"))


@pytest.fixture
def one_thread():
    """The fuzz's matmuls are tiny: on a shared CPU, more threads only spin."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("kv_dtype", ["bf16", "kv4rl"])
def test_random_ops_with_faults_keep_the_books_balanced(fuzz_model, kv_dtype, one_thread):
    report = fuzz_engine(fuzz_model, ops=1000, seed=1, kv_dtype=kv_dtype)
    print(report.table())
    assert not report.violations
    assert report.ops_tried == 1000
    for kind, count in report.faults.items():
        assert count.injected >= 3 and count.handled == count.injected, kind

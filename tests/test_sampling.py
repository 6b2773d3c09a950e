"""Batched sampling draws from the tempered, truncated distribution and reports its logprob."""

import torch

from kvstreams_sglang.engine.sampling import SamplingParams, sample_batch


def frequencies(logits, params, n=6000):
    rows = logits.expand(n, -1)
    tokens, lps = sample_batch(rows, [params] * n, [None] * n)
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[-1]).float() / n, tokens, lps


def test_samples_follow_the_tempered_distribution():
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    freq, tokens, lps = frequencies(logits, SamplingParams(temperature=0.7))
    expected = torch.softmax(logits[0] / 0.7, -1)
    assert (freq - expected).abs().max() < 0.03
    assert abs(lps[0] - float(torch.log(expected[tokens[0]]))) < 1e-6


def test_top_k_and_top_p_truncate():
    torch.manual_seed(1)
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    freq, _, _ = frequencies(logits, SamplingParams(top_k=2))
    assert freq[2:].sum() == 0 and freq[:2].min() > 0.2
    p = torch.softmax(logits[0], -1)  # 0.64, 0.23, ...: top_p 0.8 keeps the first two
    freq, _, _ = frequencies(logits, SamplingParams(top_p=0.8))
    assert freq[2:].sum() == 0 and abs(float(freq[0]) - float(p[0] / p[:2].sum())) < 0.03


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(3, 50)
    params = [SamplingParams(seed=5)] * 3

    def gens():
        return [torch.Generator().manual_seed(5) for _ in range(3)]

    a, _ = sample_batch(logits, params, gens())
    b, _ = sample_batch(logits[1:2], params[:1], gens()[:1])
    assert a[1] == b[0]

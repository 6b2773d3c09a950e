"""Batch-invariant stream attention (kernels/stream_attention.py) and matmul (kernels/batch_invariant.py),
under Triton's interpreter: correct against float64, and bit-identical whether a query is computed
the sampler's way (its stream's kept keys in shuffled pool slots, one token or a chunk) or the
trainer's way (every key of the record, eviction mask, all queries at once)."""

import pytest
import torch

from kvstreams_sglang.kernels.batch_invariant import batch_invariant, matmul, row_mean
from kvstreams_sglang.kernels.stream_attention import (
    NO_DEATH,
    key_row_map,
    plan_stream_attention,
    stream_attention,
    stream_attention_reference,
)

HQ, HKV, D = 8, 2, 128
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # on the GPU: the MMA's own row invariance


def trainer_case(t=150, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, HQ, D, generator=g).to(torch.bfloat16).to(DEV)
    k = torch.randn(t, HKV, D, generator=g).to(torch.bfloat16).to(DEV)
    v = torch.randn(t, HKV, D, generator=g).to(torch.bfloat16).to(DEV)
    death = torch.full((t,), NO_DEATH, dtype=torch.long, device=DEV)
    death[10:40] = 90  # evicted when the stream reached index 90
    death[50:61] = 120
    death[64:128] = 130  # the whole second block of positions: skipped by queries from 130 on
    pos = torch.arange(t, device=DEV)
    plan = plan_stream_attention(torch.tensor([0], device=DEV), torch.tensor([t], device=DEV), pos,
                                 key_row_map(1, torch.zeros(t, device=DEV), pos, pos),
                                 gqa_group=HQ // HKV, q_rows=pos, death=death)
    return q, k, v, death, plan


def sampler_view(q, k, v, death, first, last, seed=1):
    """Queries ``first..last`` as the engine holds them at index ``last``: kept keys only, in shuffled slots."""
    kept = [j for j in range(last + 1) if death[j] > last]
    slots = torch.randperm(400, generator=torch.Generator().manual_seed(seed))[: len(kept)].to(DEV)
    kp = torch.zeros(400, HKV, D, dtype=k.dtype, device=DEV)
    vp = torch.zeros_like(kp)
    kp[slots], vp[slots] = k[kept], v[kept]
    pos = torch.tensor(kept, device=DEV)
    n = last - first + 1
    plan = plan_stream_attention(torch.tensor([0], device=DEV), torch.tensor([n], device=DEV),
                                 torch.arange(first, last + 1, device=DEV),
                                 key_row_map(1, torch.zeros(len(kept), device=DEV), pos, slots), gqa_group=HQ // HKV)
    return q[first:last + 1], kp, vp, plan


def test_stream_attention_matches_float64_reference():
    q, k, v, _, plan = trainer_case()
    out = stream_attention(q, k, v, plan, sm_scale=D ** -0.5)
    ref = stream_attention_reference(q.cpu(), k.cpu(), v.cpu(), _cpu(plan), sm_scale=D ** -0.5)
    out = out.cpu()
    assert (out.double() - ref).abs().max() < 2e-2  # bf16 output and bf16 P
    assert (out.double() - ref).abs().mean() < 2e-3


@pytest.mark.parametrize("first,last", [(130, 130), (95, 110), (0, 0), (149, 149), (130, 149)])
def test_sampler_and_trainer_layouts_give_identical_bits(first, last):
    q, k, v, death, plan = trainer_case()
    full = stream_attention(q, k, v, plan, sm_scale=D ** -0.5)
    qs, kp, vp, splan = sampler_view(q, k, v, death, first, last)
    part = stream_attention(qs, kp, vp, splan, sm_scale=D ** -0.5)
    assert torch.equal(part, full[first:last + 1])


def _cpu(plan):
    return type(plan)(**{f: (getattr(plan, f).cpu() if isinstance(getattr(plan, f), torch.Tensor) else getattr(plan, f))
                         for f in plan.__dataclass_fields__})


def test_matmul_is_row_invariant_and_correct():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(70, 96, generator=g).to(torch.bfloat16).to(DEV)
    b = torch.randn(96, 40, generator=g).to(torch.bfloat16).to(DEV)
    bias = torch.randn(40, generator=g).to(torch.bfloat16).to(DEV)
    c = matmul(a, b, bias)
    ref = a.double() @ b.double() + bias.double()
    assert ((c.double() - ref).abs() <= ref.abs() * 2 ** -7 + 1e-4).all()  # one bf16 step (the interpreter truncates)
    for i in (0, 13, 69):
        assert torch.equal(matmul(a[i:i + 1], b, bias)[0], c[i])
    x = torch.randn(5, 1500, generator=g).to(DEV)
    assert torch.allclose(row_mean(x), x.mean(-1), atol=1e-6)


def test_override_routes_linear_and_norm_and_restores():
    lin = torch.nn.Linear(96, 40).to(torch.bfloat16).to(DEV)
    x = torch.randn(1, 70, 96).to(torch.bfloat16).to(DEV).requires_grad_(True)
    with batch_invariant(device_type=DEV.upper()):
        with batch_invariant(device_type=DEV.upper()):  # nested uses share one registration
            y = lin(x)
        y1 = lin(x[:, 5:6])
        y.float().sum().backward()  # autograd runs through the override too
        m = x.float().pow(2).mean(-1, keepdim=True)
    assert torch.equal(y1[0, 0], y[0, 5])
    assert torch.equal(y[0], matmul(x[0].detach(), lin.weight.t(), lin.bias).detach() * 1)
    assert x.grad is not None and x.grad.shape == x.shape
    assert m.shape == (1, 70, 1)
    out = lin(x[0].detach())  # after the block: the stock kernel again (not row-equal to ours in general)
    assert out.shape == (70, 40)


# ---- end to end: the engine's sampling logprobs vs the trainer's replay, bf16 ----


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory):
    from kvstreams_sglang.testing import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("bf16") / "m", num_layers=2, hidden_size=128, num_heads=4,
                                num_kv_heads=2, intermediate_size=256, dtype=torch.bfloat16))


def _episode_with_reprefill(eng):
    """Sample, append an observation, evict the first turn, re-prefill the stream in place, sample again."""
    g = torch.Generator().manual_seed(0)
    sid = eng.open_stream(torch.randint(0, 256, (20,), generator=g).tolist())
    eng.generate(sid, max_new_tokens=8, seed=1)
    start = eng.ledger(sid).end
    eng.append(sid, torch.randint(0, 256, (12,), generator=g).tolist())
    eng.generate(sid, max_new_tokens=8, seed=2)
    eng.evict(sid, [(start, start + 11)])
    eng.reprefill([sid])
    eng.append(sid, torch.randint(0, 256, (9,), generator=g).tolist())
    eng.generate(sid, max_new_tokens=8, seed=3)
    return eng.stream_record(sid)


def test_invariant_engine_and_trainer_logprobs_are_bit_equal_in_bf16(tiny_bf16):
    from transformers import AutoModelForCausalLM

    from kvstreams_sglang.engine import Engine
    from trainer_masks.scoring import stream_logprobs

    trainer = AutoModelForCausalLM.from_pretrained(tiny_bf16, dtype=torch.bfloat16).eval()
    gaps = {}
    for invariant in (True, False):
        eng = Engine(tiny_bf16, kv_dtype="bf16", device=DEV, dtype=torch.bfloat16, kv_slots=1024, max_streams=2,
                     batch_invariant=invariant)
        rec = _episode_with_reprefill(eng)
        assert rec.evictions and eng.stats.tokens_reprefilled_on_update > 0
        with torch.no_grad():
            lp = stream_logprobs(trainer.to(DEV), rec, impl="invariant" if invariant else "sdpa").float().cpu()
        idx = [i for i, s in enumerate(rec.sources) if s == "model"]
        gaps[invariant] = (lp[idx] - torch.tensor([rec.logprobs[i] for i in idx])).abs().max().item()
    # invariant: only the fp32 LM head's own summation order is left; the default kernels differ in bf16
    assert gaps[True] <= 2e-6, gaps
    assert gaps[False] > 50 * max(gaps[True], 1e-7), gaps


def test_invariant_scoring_gradients_match_the_masked_kernel(tmp_path):
    """Backward recomputes attention with SDPA + the eviction mask: same gradients as impl='sdpa' (fp32)."""
    from transformers import AutoModelForCausalLM

    from kvstreams_sglang.testing import build_tiny_model
    from trainer_masks import StreamRecord
    from trainer_masks.scoring import stream_logprobs

    path = build_tiny_model(tmp_path / "m", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                            intermediate_size=128)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEV)
    n = 48
    rec = StreamRecord(token_ids=[(7 * i) % 256 for i in range(n)], positions=list(range(n)),
                       sources=["prompt"] * 8 + ["model", "env"] * 20, loss_mask=[i % 2 == 0 for i in range(n)],
                       logprobs=[None] * n, policy_versions=[None] * n,
                       evictions=[dict(at_index=30, spans=[(8, 15)])])
    grads = {}
    for impl in ("invariant", "sdpa"):
        model.zero_grad()
        lp = stream_logprobs(model, rec, impl=impl)
        lp.sum().backward()
        grads[impl] = (lp.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
    assert torch.allclose(grads["invariant"][0], grads["sdpa"][0], atol=1e-5)
    assert grads["invariant"][1].keys() == grads["sdpa"][1].keys()
    for name, g in grads["sdpa"][1].items():
        assert torch.allclose(grads["invariant"][1][name], g, rtol=1e-3, atol=1e-5), name


def test_config_takes_the_two_switches_together():
    from harness.config import Config

    Config.model_validate({"inference": {"batch_invariant": True}, "trainer": {"impl": "invariant"}})
    for bad in ({"inference": {"batch_invariant": True}}, {"trainer": {"impl": "invariant"}},
                {"inference": {"batch_invariant": True, "kv_dtype": "kv4rl"}, "trainer": {"impl": "invariant"}}):
        with pytest.raises(ValueError, match="batch_invariant"):
            Config.model_validate(bad)

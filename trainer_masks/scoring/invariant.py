"""The trainer's side of batch-invariant scoring (``impl="invariant"``).

The packed records are handed to the same stream-attention kernel the engine's steps run with
``Engine(batch_invariant=True)`` (``kvstreams_sglang.kernels.stream_attention``), keys addressed by
(record, position) and hidden by ``death``; the matmuls and norm reductions go through the
batch-invariant kernels. In bf16 the trainer then reproduces the sampler's logprobs bit for bit
(up to the fp32 LM head's own summation order), so the importance ratio of an on-policy token is 1.

Backward does not need bit-equality: it recomputes attention with the model's regular masked
kernel (SDPA with the dense mask, or FlexAttention with the BlockMask) and differentiates that.
"""

from __future__ import annotations

import contextlib

import torch

from ..masks import PackedBatch

ATTENTION_NAME = "kvstreams_invariant"


def invariant_kernels(enabled: bool, device: torch.device) -> contextlib.AbstractContextManager:
    """The batch-invariant matmul / norm kernels on ``device`` for the block (imported here: the
    kernels pull in Triton, which plain scoring does not need)."""
    if not enabled:
        return contextlib.nullcontext()
    from kvstreams_sglang.kernels.batch_invariant import batch_invariant

    return batch_invariant(device_type=device.type.upper())


def packed_plan(packed: PackedBatch, gqa_group: int):
    """The kernel's plan for a packed batch: every token is a query; keys by (record, position)."""
    from kvstreams_sglang.kernels.stream_attention import key_row_map, plan_stream_attention

    pos = packed.position_ids[0]
    if len(packed) > 1 and bool(((pos[1:] <= pos[:-1]) & (packed.document_ids[1:] == packed.document_ids[:-1])).any()):
        raise ValueError("impl='invariant' needs strictly increasing positions within each record (a KV stream's)")
    rows = torch.arange(len(packed), device=pos.device)
    starts = torch.tensor(packed.offsets, device=pos.device)
    counts = torch.tensor(packed.lengths, device=pos.device)
    key_rows = key_row_map(len(packed.lengths), packed.document_ids, pos, rows)
    return plan_stream_attention(starts, counts, pos, key_rows, gqa_group=gqa_group, q_rows=rows, death=packed.death)


class _InvariantAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, module, query, key, value, plan, mask, backward_impl, scaling):
        from kvstreams_sglang.kernels.stream_attention import stream_attention

        ctx.save_for_backward(query, key, value)
        ctx.module, ctx.mask, ctx.backward_impl, ctx.scaling = module, mask, backward_impl, scaling
        # [1, H, N, D] -> [N, H, D] views; the kernel takes any row / head strides
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
        return stream_attention(q, k, v, plan, sm_scale=scaling)[None]  # [1, N, Hq, D]

    @staticmethod
    def backward(ctx, grad_out):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        with torch.enable_grad():
            out, _ = ALL_ATTENTION_FUNCTIONS[ctx.backward_impl](ctx.module, *inputs, ctx.mask, scaling=ctx.scaling)
            wanted = [t for t in inputs if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad_out)) if wanted else iter(())
        return (None, *(next(grads) if t.requires_grad else None for t in inputs), None, None, None, None)


def invariant_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, stream_plan=None,
                        backward_impl="sdpa", **kwargs):
    """HF attention-interface entry point: ``query [1, Hq, N, D]`` -> ``[1, N, Hq, D]``; the
    ``attention_mask`` (dense or BlockMask) is only used by backward."""
    if stream_plan is None:
        raise RuntimeError("the 'kvstreams_invariant' attention needs a stream_plan: score through "
                           "trainer_masks.stream_logprobs(..., impl='invariant')")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = _InvariantAttention.apply(module, query, key, value, stream_plan, attention_mask, backward_impl, scale)
    return out, None


def register() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, invariant_attention)
    return ATTENTION_NAME

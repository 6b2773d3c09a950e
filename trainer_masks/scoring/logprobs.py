"""Score KV streams with a Hugging Face causal LM: one forward over the packed records.

Every token is scored under exactly the context it was sampled in: the eviction mask stands in
for the engine's KV cache (each key's own hidden states were computed under its own mask row, as
the engine computed its KV before later evictions), and explicit ``position_ids`` keep each
token's original RoPE position, gaps included.

Transformers builds its own causal mask unless ``attention_mask`` is a dict keyed by layer type;
we pass that dict, so the model's masking code never runs. The mask format must match the
attention kernel, so ``impl`` picks both: for the duration of the call the model's attention
implementation is switched to ``"sdpa"`` (mask: bool ``[1, 1, N, N]``) or ``"flex_attention"``
(mask: ``BlockMask``) and then restored. Grad mode is the caller's: wrap in ``torch.no_grad()``
to score the old policy (FlexAttention has no CPU backward).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal, overload

import torch

from ..masks import PackedBatch, flex_block_mask, pack
from ..record import StreamRecord
from .invariant import invariant_kernels, packed_plan
from .invariant import register as register_invariant
from .lm_head import decoder, fp32_logits

Impl = Literal["auto", "sdpa", "flex", "invariant"]
HF_ATTENTION = {"sdpa": "sdpa", "flex": "flex_attention", "invariant": "kvstreams_invariant"}
ROWS_PER_CHUNK = 1024  # bounds the float32 [rows, vocab] buffer at ~0.6 GB for a 152k vocab


@dataclass(frozen=True)
class StreamScores:
    """Per-token scores of one record; entry ``i`` comes from the prediction at query ``i - 1``
    (entry 0 has no prediction and is 0)."""

    logprobs: torch.Tensor  # [T] float32, log p(token_i | context visible to query i - 1)
    entropy: torch.Tensor  # [T] float32, entropy of that predictive distribution
    loss_mask: torch.Tensor  # [T] bool


def resolve_impl(impl: Impl, device: torch.device) -> Literal["sdpa", "flex", "invariant"]:
    """``"auto"``: FlexAttention on CUDA, where block sparsity skips evicted keys; SDPA elsewhere,
    where compiling flex costs more than the dense mask saves. ``"invariant"``: batch-invariant
    kernels (``trainer_masks.scoring.invariant``), bit-equal to an ``Engine(batch_invariant=True)``."""
    if impl == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if impl not in HF_ATTENTION:
        raise ValueError(f"impl must be 'auto', 'sdpa' or 'flex', got {impl!r}")
    return impl


@contextmanager
def attention_implementation(model: torch.nn.Module, name: str) -> Iterator[None]:
    """Run the block with the model's attention implementation set to ``name``, then restore it."""
    previous = model.config._attn_implementation
    if previous != name:
        model.set_attn_implementation(name)
    try:
        yield
    finally:
        if previous != name:
            model.set_attn_implementation(previous)


def layer_masks(model: torch.nn.Module, mask: torch.Tensor | object) -> torch.Tensor | object:
    """The mask to hand the model: a ready 4D mask or BlockMask, which transformers' mask
    construction passes through unchanged (every model family accepts it, unlike the
    per-layer-type dict only some accept)."""
    layer_types = set(getattr(model.config.get_text_config(), "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"}:
        # A sliding-window layer needs the window *and* the eviction rule; refuse rather than drop the window.
        raise NotImplementedError(f"only full-attention layers are supported, model has {sorted(layer_types)}")
    return mask


def token_logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [M, V]``, ``targets [M]`` -> float32 ``logprobs [M]``, ``entropy [M]``."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    # clamp: a vocabulary entry masked to -inf has p = 0 and must add 0, not 0 * -inf = nan
    entropy = -(logp.exp() * logp.clamp_min(torch.finfo(torch.float32).min)).sum(-1)
    return logp.gather(-1, targets[:, None]).squeeze(-1), entropy


def hidden_logprobs_and_entropy(
    model: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Final hidden states ``[M, H]`` -> ``token_logprobs_and_entropy`` of the fp32 LM head's logits,
    in row chunks so only one float32 ``[rows, V]`` block is alive at a time (under autograd each
    chunk's is kept for backward; a fused kernel would be needed to avoid that)."""
    weight = model.get_output_embeddings().weight.float()
    logprobs, entropy = [], []
    for start in range(0, max(len(hidden), 1), ROWS_PER_CHUNK):
        rows = slice(start, start + ROWS_PER_CHUNK)
        lp, ent = token_logprobs_and_entropy(fp32_logits(model, hidden[rows], weight), targets[rows])
        logprobs.append(lp)
        entropy.append(ent)
    return torch.cat(logprobs), torch.cat(entropy)


def score_packed(model: torch.nn.Module, packed: PackedBatch, *, impl: Impl = "auto") -> list[StreamScores]:
    """One masked forward over an already packed batch."""
    device = model.device
    impl = resolve_impl(impl, device)
    packed = packed.to(device)
    extra = {}
    masked = impl
    if impl == "invariant":
        # forward: the stream-attention kernel; the regular mask is only built for backward
        masked = resolve_impl("auto", device)
        text = model.config.get_text_config()
        extra = dict(stream_plan=packed_plan(packed, text.num_attention_heads // text.num_key_value_heads),
                     backward_impl=HF_ATTENTION[masked])
        register_invariant()
    if impl == "invariant" and not torch.is_grad_enabled():
        mask = None
    elif masked == "flex":
        mask = flex_block_mask(packed, device)
    else:
        mask = packed.dense_mask()[None, None]  # [1, 1, N, N] bool, True = attend
    # The fp32 head runs inside the model's own forward (a hook on the final norm): under FSDP2
    # the root's parameters (embeddings, LM head) are only unsharded there, and gradients of
    # the head then flow through FSDP's own backward hooks.
    scores: dict[str, torch.Tensor] = {}

    def head(_module, _args, output):
        hidden = output[0] if isinstance(output, tuple) else output  # [1, N, H]
        # row j predicts token j + 1; shift so entry j holds the score of token j
        scores["lp"], scores["ent"] = hidden_logprobs_and_entropy(model, hidden[0, :-1], packed.input_ids[0, 1:])

    hook = decoder(model).norm.register_forward_hook(head)
    try:
        with attention_implementation(model, HF_ATTENTION[impl]), invariant_kernels(impl == "invariant", device):
            model(
                input_ids=packed.input_ids,
                position_ids=packed.position_ids,
                attention_mask=layer_masks(model, mask),
                use_cache=False,
                logits_to_keep=1,  # the model's own (bf16) head only for one row; ours is above
                **extra,
            )
    finally:
        hook.remove()
    logprobs, entropy = scores["lp"], scores["ent"]  # [N - 1]
    first = torch.zeros(1, device=device)
    logprobs, entropy = torch.cat([first, logprobs]), torch.cat([first, entropy])  # [N]
    # a record's first token is predicted from the previous record's last row: not a prediction
    starts = torch.tensor(packed.offsets, device=device)
    logprobs, entropy = logprobs.index_fill(0, starts, 0.0), entropy.index_fill(0, starts, 0.0)
    return [
        StreamScores(lp, ent, lm)
        for lp, ent, lm in zip(
            packed.split(logprobs), packed.split(entropy), packed.split(packed.loss_mask), strict=True
        )
    ]


def score_streams(
    model: torch.nn.Module, records: Sequence[StreamRecord], *, impl: Impl = "auto"
) -> list[StreamScores]:
    """Logprobs, entropies and loss masks of ``records``, scored together in one forward."""
    return score_packed(model, pack(records), impl=impl)


@overload
def stream_logprobs(model: torch.nn.Module, records: StreamRecord, *, impl: Impl = ...) -> torch.Tensor: ...
@overload
def stream_logprobs(
    model: torch.nn.Module, records: Sequence[StreamRecord], *, impl: Impl = ...
) -> list[torch.Tensor]: ...
def stream_logprobs(model, records, *, impl="auto"):
    """Per-token logprobs ``[T]`` (float32, entry 0 is 0) of one record, or a list for several."""
    if isinstance(records, StreamRecord):
        return score_streams(model, [records], impl=impl)[0].logprobs
    return [s.logprobs for s in score_streams(model, records, impl=impl)]

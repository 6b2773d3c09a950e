"""Re-prefill under new weights: replay streams with the trainer's mask, rewrite their KV in place.

After ``update_weights`` the kept KV of a stream was computed by older policies. ``replay``
recomputes it with the current weights the way the trainer scores the stream: one forward over
each stream's computed tokens, evicted ones included, at their original positions, under the
eviction mask ``k <= q < death[k]`` (a kept token's KV depends on every token that was alive
when it was written). The model runs with a registered attention function (``kvstreams_replay``,
switched in for the call, like ``trainer_masks`` switches to SDPA / FlexAttention) that hands
each layer's post-norm, post-RoPE keys/values of the still-resident tokens to the pool's store
path (a slot write for the full-precision pool, ``kv4_store`` with INT8 side copies for KV4)
and then computes attention with HF's own SDPA / FlexAttention function and the trainer's mask,
so the hidden states feeding the next layer are the trainer's. No model code is rewritten.
"""

from __future__ import annotations

import contextlib

import torch

from trainer_masks.scoring.invariant import invariant_kernels
from trainer_masks.scoring.invariant import register as register_invariant
from trainer_masks.scoring.lm_head import decoder
from trainer_masks.scoring.logprobs import attention_implementation, layer_masks

from ..kernels import kv4_store
from ..kv4.reference import store_reference
from ..streams import FullPrecisionPool, KV4Pool
from .batch import ReplayBatch

REPLAY_ATTENTION = "kvstreams_replay"


class ReplayWriter:
    """Per layer: write the resident tokens' new K/V into their existing slots."""

    def __init__(self, batch: ReplayBatch, pool: FullPrecisionPool | KV4Pool):
        self.batch, self.pool = batch, pool
        self.layers_written = 0

    def store(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        # key/value [1, Hkv, N, D] -> the live rows [L, Hkv, D]
        b = self.batch
        k = key[0].transpose(0, 1)[b.live_rows]
        v = value[0].transpose(0, 1)[b.live_rows]
        if isinstance(self.pool, KV4Pool):  # the kernel on CUDA, its reference elsewhere (as KV4Backend "auto")
            store = kv4_store if k.is_cuda else store_reference
            store(self.pool.layers[layer], k, v, b.live_slots, b.side_slots)
        else:
            kp, vp = self.pool.k[layer], self.pool.v[layer]
            kp[b.live_slots] = k.to(kp.dtype)
            vp[b.live_slots] = v.to(vp.dtype)
        self.layers_written += 1


def replay_attention(module, query, key, value, attention_mask, *, kv_replay: ReplayWriter | None = None, **kwargs):
    """HF attention-interface entry point: store, then attend like the trainer."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if kv_replay is None:
        raise RuntimeError(f"the {REPLAY_ATTENTION!r} attention needs a kv_replay kwarg: run it through "
                           "kvstreams_sglang.engine.replay.replay")
    kv_replay.store(module.layer_idx, key, value)
    return ALL_ATTENTION_FUNCTIONS[kv_replay.batch.attention](module, query, key, value, attention_mask, **kwargs)


def register() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(REPLAY_ATTENTION, replay_attention)
    return REPLAY_ATTENTION


@torch.inference_mode()
def replay(model: torch.nn.Module, pool: FullPrecisionPool | KV4Pool, batch: ReplayBatch) -> None:
    """One masked forward over ``batch`` that rewrites its resident tokens' KV in ``pool``."""
    writer = ReplayWriter(batch, pool)
    mask = layer_masks(model, batch.mask)  # refuses sliding-window layers, as the trainer does
    device = batch.packed.input_ids.device
    # Triton (kv4_store) launches on the calling thread's current device: make it the engine's.
    on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    invariant = batch.stream_plan is not None
    extra = {"stream_plan": batch.stream_plan} if invariant else {}
    if invariant:
        register_invariant()
    with on_device, attention_implementation(model, register()), invariant_kernels(invariant, device):
        decoder(model)(input_ids=batch.packed.input_ids, position_ids=batch.packed.position_ids,
                       attention_mask=mask, use_cache=False, kv_replay=writer, **extra)
    num_layers = len(pool.layers) if isinstance(pool, KV4Pool) else len(pool.k)
    if writer.layers_written != num_layers:
        raise RuntimeError(f"re-prefill wrote {writer.layers_written} of {num_layers} layers' KV: the model's "
                           f"attention did not go through {REPLAY_ATTENTION!r}")

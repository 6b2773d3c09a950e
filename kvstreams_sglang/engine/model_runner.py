"""Loads a Hugging Face decoder checkpoint and runs one ``ForwardBatch`` through it.

All streams of a step are packed into one row ``[1, N]`` with explicit stream positions;
HF's own mask construction is bypassed (we pass a ready mask mapping of ``None``) since
attention is ours; only the last token of each stream goes through the LM head.
"""

from __future__ import annotations

import contextlib

import torch

from trainer_masks.scoring.lm_head import decoder, fp32_logits

from ..kernels.batch_invariant import batch_invariant
from .attention import register
from .batch import ForwardBatch


def load_model(model_path: str, *, device, dtype: torch.dtype | None):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    if dtype is None:
        dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    device = torch.device(device)
    extra = {"device_map": str(device)} if device.type == "cuda" else {}  # load straight onto the GPU
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation=register(), **extra)
    model.to(device).eval()
    return model, config


def adopt_model(model, *, device):
    """An already-loaded model, run with our attention (``register``): it must sit on ``device``."""
    where = next(model.parameters()).device
    if where.type != torch.device(device).type:
        raise ValueError(f"the model is on {where}, the engine on {device}")
    model.set_attn_implementation(register())
    return model.eval(), model.config


class ModelRunner:
    """``batch_invariant``: matmuls and norm reductions through ``kernels.batch_invariant`` (the
    trainer's scoring with ``impl="invariant"`` does the same), so a token's hidden states do not
    depend on what else the step computes. ``model``: an already-loaded model instead of ``model_path``."""

    def __init__(self, model_path: str | None, *, device, dtype: torch.dtype | None = None,
                 batch_invariant: bool = False, model=None):
        self.device = torch.device(device)
        self.batch_invariant = batch_invariant
        if (model_path is None) == (model is None):
            raise ValueError("give exactly one of model_path and model")
        self.model, self.config = (load_model(model_path, device=self.device, dtype=dtype) if model is None
                                   else adopt_model(model, device=self.device))
        self.dtype = next(self.model.parameters()).dtype
        text = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        self.num_layers = text.num_hidden_layers
        self.num_kv_heads = text.num_key_value_heads
        self.num_heads = text.num_attention_heads
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self.layer_types = sorted(set(getattr(text, "layer_types", None) or ["full_attention"]))
        self.vocab_size = self.model.get_input_embeddings().num_embeddings  # token ids the embedding can look up
        self._head_fp32: torch.Tensor | None = None  # fp32 copy of the LM head, refreshed on weight updates

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, backend) -> torch.Tensor:
        """Returns logits ``[B, V]`` (float32, fp32 LM head) at each stream's last new token."""
        # Triton launches on the calling thread's current device: make it the engine's (a
        # trainer may share the process on another GPU)
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext(), \
                batch_invariant(self.batch_invariant, device_type=self.device.type.upper()):
            hidden = decoder(self.model)(
                input_ids=fb.input_ids[None],
                position_ids=fb.positions[None],
                attention_mask={t: None for t in ("full_attention", "sliding_attention", *self.layer_types)},
                use_cache=False,
                kv_batch=fb,
                kv_backend=backend,
            ).last_hidden_state[0]  # [N, H]
        if self._head_fp32 is None:
            self._head_fp32 = self.model.get_output_embeddings().weight.float()
        return fp32_logits(self.model, hidden[fb.logits_indices], self._head_fp32)

    @torch.no_grad()
    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy new weights into the live parameters (no reallocation, KV untouched)."""
        # remove_duplicate=False: a trainer's state dict names tied weights (lm_head / embeddings) twice.
        params = dict(self.model.named_parameters(remove_duplicate=False))
        params.update(dict(self.model.named_buffers(remove_duplicate=False)))
        unknown = [k for k in state_dict if k not in params]
        if unknown:
            raise KeyError(f"update_weights: unknown parameter names {unknown[:5]}")
        for name, tensor in state_dict.items():
            if params[name].shape != tensor.shape:
                raise ValueError(f"update_weights: {name} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(params[name].shape)}")
            params[name].copy_(tensor)
        self._head_fp32 = None

"""``--hf-numerics``: the model's norms, RoPE, activation and merged projections round as Hugging Face
transformers rounds them in the model dtype, the numerics of the built-in engine and of the trainer.

Why: SGLang's kernels compute the same functions in other orders and precisions: RMSNorm multiplies the
weight in fp32 and rounds once (HF rounds the normalised input to bf16, then multiplies by the bf16 weight),
the fused residual add normalises the fp32 sum (HF the bf16 sum), the q/k norms run as one fused in-place
kernel, RoPE reads an fp32 cos/sin cache (HF rounds cos/sin to bf16 and rounds each product), SiLU-and-mul
rounds once (HF twice), and the QKV and gate/up projections are single GEMMs over concatenated weights. Each
difference is a last bit; with ``--kv4rl`` the INT4 rounding of K/V turns last bits into whole code steps, and
the logprobs of the same stream drift from the built-in engine's (on the H200, 2026-12-02: max 4.0e-2, mean
9.3e-3 on a random 4-layer model) and from the trainer's. Under this flag each of those modules runs HF's own
code (``transformers``' RMSNorm forward, rotary embedding, ``apply_rotary_pos_emb`` and activation) on the
same tensors, and each merged projection runs one GEMM per part, as HF's separate ``nn.Linear`` modules do.

The cost is launches: on CUDA a few more small kernels per layer (captured in the CUDA graphs); the norms, the
most of them in HF's code, run as one kernel each that rounds as HF's code does (``kernels.hf_rms_norm``). Off by
default: a user trades decode speed for on-policy logprobs. Only Qwen3 checkpoints are supported (the
architecture the project trains); another architecture is refused with the reason. ``--hf-numerics-parts``
aligns only some parts (``PARTS``), to tell which carries a gap and what each costs: on the CPU the norms alone
give the bit-equality (SGLang's CPU RoPE, activation and GEMMs already round as HF's; ``bench.sglang_parity``).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from ..kernels import hf_rms_norm

SUPPORTED = ("qwen3",)


class HFNumericsError(ValueError):
    """A model ``--hf-numerics`` cannot align with transformers."""


# what --hf-numerics-parts may name: each part of the model it aligns (all by default), so that a device run can
# tell which part carries a parity gap and what each costs
PARTS = ("norms", "rope", "activation", "gemms", "qk_prepare")


def parse_parts(text: str) -> tuple[str, ...]:
    """``--hf-numerics-parts`` (``all`` or a comma list of ``PARTS``) -> the parts, validated."""
    if text.strip() == "all":
        return PARTS
    parts = tuple(p.strip() for p in text.split(",") if p.strip())
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise HFNumericsError(f"--hf-numerics-parts: {', '.join(unknown) or 'nothing'} is not one of all, "
                              f"{', '.join(PARTS)}")
    return parts


def hf_modules(hf_config):
    """(RMSNorm class, rotary embedding class, apply_rotary_pos_emb, activation) of the checkpoint's HF model."""
    from transformers import AutoModelForCausalLM
    from transformers.activations import ACT2FN

    if hf_config.model_type not in SUPPORTED:
        raise HFNumericsError(f"--hf-numerics aligns {', '.join(SUPPORTED)} models with transformers; this checkpoint "
                              f"is {hf_config.model_type!r}")
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_config)
    modeling = sys.modules[type(hf.model.layers[0].self_attn).__module__]
    return type(hf.model.norm), type(hf.model.rotary_emb), modeling.apply_rotary_pos_emb, ACT2FN[hf_config.hidden_act]


def rope_table(rotary_cls, hf_config, rows: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's cos and sin for positions ``[0, rows)``, as its rotary module returns them for any position ids: its
    inverse frequencies computed on the CPU (as ``from_pretrained`` initialises them), the products and cos/sin on
    ``device`` in fp32 (TF32 off, as in an HF forward that did not turn it on), rounded to ``dtype``. Each position's
    row depends on that position alone, so one lookup table equals a call per step."""
    rotary = rotary_cls(config=hf_config).to(device)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        cos, sin = rotary(torch.empty(0, device=device, dtype=dtype),
                          torch.arange(rows, device=device)[None])
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return cos[0].contiguous(), sin[0].contiguous()


def _norm_forward(module, hf_forward, fused: bool = True):
    """HF's norm; on CUDA the one-kernel form of it (``kernels.hf_rms_norm``: HF's code is ~8 launches a norm).
    ``fused=False``: HF's code everywhere (``--kv4rl-batch-invariant``: its mean then runs the batch-invariant row
    mean, as in the built-in engine's ``batch_invariant``; the fused kernel sums in another order)."""
    def forward(x, residual=None, post_residual_addition=None):
        if residual is not None and post_residual_addition is not None:
            residual = residual + post_residual_addition
        if fused and x.is_cuda and hf_rms_norm.supported(x, module.weight):
            return hf_rms_norm.hf_rms_norm(x, module.weight, module.variance_epsilon, residual)
        if residual is None:
            return hf_forward(module, x)
        residual = residual + x  # HF: ``hidden_states = residual + hidden_states``, rounded, then normalised
        return hf_forward(module, residual), residual
    return forward


def _rope_forward(module, apply_rotary_pos_emb, cos_table, sin_table):
    def forward(positions, query, key, offsets=None, fused_set_kv_buffer_arg=None):
        if fused_set_kv_buffer_arg is not None:
            raise HFNumericsError("--hf-numerics: RoPE fused with the KV store is not supported")
        if offsets is not None:
            positions = positions + offsets
        positions = positions.flatten()
        cos, sin = cos_table[positions], sin_table[positions]
        t, d = positions.shape[0], module.head_size
        q, k = apply_rotary_pos_emb(query.reshape(t, -1, d), key.reshape(t, -1, d), cos, sin, unsqueeze_dim=1)
        return q.reshape(query.shape), k.reshape(key.shape)
    return forward


def _split_gemm_forward(layer):
    """One GEMM per output part (HF's q/k/v and gate/up ``nn.Linear``s) over row slices of the merged weight."""
    sizes = list(layer.output_partition_sizes)

    def forward(x):
        return torch.cat([F.linear(x, w) for w in layer.weight.split(sizes, dim=0)], dim=-1), None
    return forward


def _act_forward(act):
    def forward(x):
        d = x.shape[-1] // 2
        return act(x[..., :d]) * x[..., d:]  # HF: ``act_fn(gate_proj(x)) * up_proj(x)``
    return forward


def _qk_prepare(attn):
    """Qwen3's projection, q/k norms and RoPE through the modules (SGLang's CUDA path fuses the two norms into one
    in-place kernel that bypasses them)."""
    def forward_prepare_native(positions, hidden_states):
        qkv, _ = attn.qkv_proj(hidden_states)
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        d = attn.head_dim
        q = attn.q_norm(q.reshape(-1, d)).view(q.shape)
        k = attn.k_norm(k.reshape(-1, d)).view(k.shape)
        q, k = attn.rotary_emb(positions, q, k)
        return q, k, v
    return forward_prepare_native


def apply(model, hf_config, parts: tuple[str, ...] = PARTS, *, fused_norms: bool = True) -> dict[str, int]:
    """Switch ``model``'s modules (an SGLang model, after loading) to HF numerics, those of ``parts``; returns how
    many of each kind. ``fused_norms``: the norms' one-kernel form on CUDA (``_norm_forward``)."""
    from sglang.srt.layers.activation import SiluAndMul
    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod
    from sglang.srt.layers.rotary_embedding import RotaryEmbedding
    from sglang.srt.models.qwen3 import Qwen3Attention

    norm_cls, rotary_cls, apply_rope, act = hf_modules(hf_config)
    counted = dict(zip(PARTS, ("norms", "ropes", "activations", "merged_gemms", "attentions"), strict=True))
    counts = {counted[p]: 0 for p in parts}
    tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, m in model.named_modules():
        kind = type(m)
        if kind is RMSNorm and "norms" in parts:
            m._forward_method = _norm_forward(m, norm_cls.forward, fused_norms)
            counts["norms"] += 1
        elif kind is RotaryEmbedding and "rope" in parts:
            if id(m) not in tables:
                tables[id(m)] = rope_table(rotary_cls, hf_config, m.cos_sin_cache.shape[0],
                                           m.cos_sin_cache.device, next(model.parameters()).dtype)
                m._forward_method = _rope_forward(m, apply_rope, *tables[id(m)])
                counts["ropes"] += 1
        elif kind in (QKVParallelLinear, MergedColumnParallelLinear) and "gemms" in parts:
            if not isinstance(m.quant_method, UnquantizedLinearMethod) or m.bias is not None:
                raise HFNumericsError(f"--hf-numerics needs unquantized projections without bias; {name} is "
                                      f"{type(m.quant_method).__name__}{' with a bias' if m.bias is not None else ''}")
            m.forward = _split_gemm_forward(m)
            counts["merged_gemms"] += 1
        elif kind is SiluAndMul and "activation" in parts:
            m._forward_method = _act_forward(act)
            counts["activations"] += 1
        elif kind is Qwen3Attention and "qk_prepare" in parts:
            m.forward_prepare_native = _qk_prepare(m)
            counts["attentions"] += 1
        elif (isinstance(m, RMSNorm) and kind is not RMSNorm and "norms" in parts) or (
                isinstance(m, RotaryEmbedding) and kind is not RotaryEmbedding and "rope" in parts):
            raise HFNumericsError(f"--hf-numerics: {name} is a {kind.__name__}, which it does not align with HF")
    missing = [k for k, n in counts.items() if n == 0]
    if missing:  # a model built from other SGLang classes than the ones aligned here would stay as it was, silently
        raise HFNumericsError(f"--hf-numerics found no {', '.join(missing)} to align in {type(model).__name__}")
    return counts

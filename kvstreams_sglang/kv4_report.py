"""`make kv4-report`: quantise a real (tiny, random) Qwen3 model's KV cache to KV4-RL
and report what it costs (bits per element, bytes vs BF16) and what it changes
(attention error per layer against exact float64 attention).

The model runs through Hugging Face with a registered attention function that records
each layer's post-RoPE queries, keys and values; the last query then attends to the
recorded history through ``single_decode`` (Triton kernels, interpreted on CPU).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _record_attention(store: list):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, attention_mask, **kwargs):
        # query [B, Hq, T, D], key/value [B, Hkv, T, D], post-RoPE.
        store.append((query[0].detach(), key[0].detach(), value[0].detach()))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    return attention


def run(model_path: str | None, num_tokens: int, seed: int) -> list[dict]:
    from rich.console import Console
    from rich.table import Table
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

    from .checkpoints import build_tiny_model
    from .kernels import single_decode
    from .kv4 import int4_bytes_per_vector, quantize_int4

    if model_path is None:
        model_path = build_tiny_model(tempfile.mkdtemp(prefix="kvstreams-kv4-report-"), num_layers=4, seed=seed)
    records: list = []
    AttentionInterface.register("kv4_probe", _record_attention(records))
    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, attn_implementation="kv4_probe", dtype=torch.float32)
    text = ("You are in a kitchen. There is a fridge, a counter and a closed door to the north. " * 40)
    ids = tok(text, return_tensors="pt").input_ids[:, :num_tokens]
    with torch.no_grad():
        model(ids)

    rows = []
    for layer, (q, k, v) in enumerate(records):
        q_last, k_hist, v_hist = q[:, -1], k.transpose(0, 1), v.transpose(0, 1)  # [Hq, D], [L, Hkv, D]
        group = q_last.shape[0] // k_hist.shape[1]
        kk = k_hist.double().repeat_interleave(group, 1).transpose(0, 1)
        vv = v_hist.double().repeat_interleave(group, 1).transpose(0, 1)
        w = torch.softmax(torch.einsum("hd,hld->hl", q_last.double(), kk) * model.config.head_dim ** -0.5, -1)
        exact = torch.einsum("hl,hld->hd", w, vv)
        errs = {}
        for name, sink, recent in (("kv4rl", 16, 128), ("int4_only", 0, 0)):
            out = single_decode(q_last, k_hist, v_hist, sink=sink, recent=recent, impl="triton")
            errs[name] = float((out.double() - exact).norm() / exact.norm())
        rows.append(dict(layer=layer, tokens=k_hist.shape[0], bits_per_element=quantize_int4(k_hist).bits_per_element,
                         **{f"rel_err_{n}": e for n, e in errs.items()}))

    d = model.config.head_dim
    table = Table(title=f"KV4-RL on {os.path.basename(str(model_path))}: {ids.shape[1]} tokens, head_dim {d}")
    for col in ("layer", "INT4 bits/elem", "rel err kv4rl (sink16+recent128)", "rel err INT4 everywhere"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["layer"]), f"{r['bits_per_element']:.2f}", f"{r['rel_err_kv4rl']:.4f}",
                      f"{r['rel_err_int4_only']:.4f}")
    console = Console()
    console.print(table)
    console.print(f"bytes per token-head K or V vector: INT4 {int4_bytes_per_vector(d)} vs BF16 {2 * d} "
                  f"({2 * d / int4_bytes_per_vector(d):.2f}x fewer)")
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None, help="local Hugging Face checkpoint (default: build a tiny Qwen3)")
    p.add_argument("--num-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    run(a.model_path, a.num_tokens, a.seed)


if __name__ == "__main__":
    main()

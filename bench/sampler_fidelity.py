"""Issue 11, evidence 3: sampler fidelity ``D_sampler`` of quantised KV caches.

The shared-prefix conditional KL: over prefixes sampled by the BF16 path, the next-token
``KL(p_bf16 || p_quant)``, for KV8 everywhere, KV4 unprotected (no sink, no recent window),
KV4 with 16 sink + 128 recent positions in INT8, and the same 144-position INT8 budget spent on
sinks only or on recent positions only.

Episodes: the texts of real TextWorld episodes (``bench/data/textworld_turns.json``): the first
observation is rendered with the model's chat template, the model samples each command on the
built-in engine with BF16 KV (temperature 1, stop at end-of-turn), and the recorded game answer
is appended, as in the agent loop. Each sampled stream is then teacher-forced through the model
once per configuration with a *fake-quant* attention (``kv4_fakequant``, registered as a
Hugging Face attention function: no model code is rewritten) that applies the exact KV4-RL format
functions (``kvstreams_sglang.kv4``): keys Hadamard-rotated after RoPE and queries rotated the
same way, INT4 codes with fp16 scale and offset, INT8 (symmetric, fp16 scale) for protected
positions, INT8 queries for quantised keys. Dense attention is computed with each version and
the one the engine would read is picked per (query, key):

- a token computed in a *decode* step at position ``q`` sees its own and every earlier key
  quantised, key ``p`` in INT8 iff ``p < sink`` or ``p > q - recent`` (``kv4.regions``), else INT4;
- a token computed in an *extend* step (a prompt or an appended observation, with the last
  sampled token) sees the keys of its own step in full precision and the earlier ones quantised
  with the region split of the step start ``s``: INT8 iff ``p < sink`` or ``p >= s - recent``.

That is the engine's KV4 semantics exactly; ``engine_check`` verifies it: an engine with
``kv_dtype="kv4rl"`` samples a multi-turn stream and its logprobs are compared with the
fake-quant teacher-forced ones at the same tokens (and likewise for ``bf16``).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from kvstreams_sglang.kv4.regions import protected_mask

from .replay import DATA

ATTENTION = "kv4_fakequant"
# name -> (mode, sink, recent)
CONFIGS = {
    "kv8": ("kv8", 0, 0),
    "kv4_unprotected": ("kv4", 0, 0),
    "kv4_sink16_recent128": ("kv4", 16, 128),
    "kv4_sink144": ("kv4", 144, 0),
    "kv4_recent144": ("kv4", 0, 144),
}


@dataclass
class FakeQuant:
    """What ``fakequant_attention`` applies to one sequence ``[N]``. ``mode``: ``bf16`` (no
    quantisation), ``kv8`` (every quantised key INT8) or ``kv4`` (INT8 if protected, else INT4).
    ``step_start[q]``: first position of the engine step that computed token ``q`` (``q`` itself
    for a decode step); ``is_decode[q]``: whether that step was a decode."""

    mode: str
    sink: int
    recent: int
    step_start: torch.Tensor  # [N] long
    is_decode: torch.Tensor  # [N] bool
    block: int = 512  # query rows per block (bounds the [H, rows, N] score tensors)


def regions(fq: FakeQuant, rows: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Boolean ``[rows, N]`` masks: full precision, INT8, INT4 (disjoint, union = causal)."""
    p = torch.arange(n, device=rows.device)[None]
    q = rows[:, None]
    causal = p <= q
    start, dec = fq.step_start[rows][:, None], fq.is_decode[rows][:, None]
    full = causal & ~dec & (p >= start)
    if fq.mode == "bf16":
        return causal, torch.zeros_like(causal), torch.zeros_like(causal)
    quant = causal & ~full
    if fq.mode == "kv8":
        return full, quant, torch.zeros_like(quant)
    end = torch.where(dec, q + 1, start)  # the engine's region split: end of the stream as the step sees it
    protected = protected_mask(p, end, sink=fq.sink, recent=fq.recent)
    return full, quant & protected, quant & ~protected


def fakequant_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, fq: FakeQuant = None,
                        **kwargs):
    """HF attention interface: ``query [1, Hq, N, D]``, ``key/value [1, Hkv, N, D]`` (after RoPE)
    -> ``([1, N, Hq, D], None)``. Causal over one sequence; see the module docstring."""
    from kvstreams_sglang.kv4 import dequantize_int4, dequantize_int8, hadamard, quantize_int4, quantize_int8

    if fq is None:
        raise RuntimeError(f"the {ATTENTION!r} attention needs an fq=FakeQuant(...) keyword")
    _, hq, n, d = query.shape
    hkv = key.shape[1]
    g = hq // hkv
    scale = scaling if scaling is not None else d ** -0.5
    q = query[0].float().reshape(hkv, g, n, d)
    k, v = key[0].float(), value[0].float()  # [Hkv, N, D]
    if fq.mode != "bf16":
        # exactly the engine's store / query path: rotate keys and queries, quantise per vector
        kr = hadamard(k)
        q8 = dequantize_int8(quantize_int8(hadamard(q)))
        k8, v8 = dequantize_int8(quantize_int8(kr)), dequantize_int8(quantize_int8(v))
        k4, v4 = dequantize_int4(quantize_int4(kr)), dequantize_int4(quantize_int4(v))
    out = torch.empty(hkv, g, n, d, dtype=torch.float32, device=query.device)
    for r0 in range(0, n, fq.block):
        rows = torch.arange(r0, min(n, r0 + fq.block), device=query.device)
        full, int8, int4 = regions(fq, rows, n)
        s = torch.where(full, (q[:, :, rows] @ k.transpose(-1, -2)[:, None]) * scale, -math.inf)
        if fq.mode != "bf16":
            qb = q8[:, :, rows]
            s = torch.where(int8, (qb @ k8.transpose(-1, -2)[:, None]) * scale, s)
            if fq.mode == "kv4":
                s = torch.where(int4, (qb @ k4.transpose(-1, -2)[:, None]) * scale, s)
        p = torch.softmax(s, dim=-1)  # [Hkv, G, rows, N]
        o = (p * full) @ v[:, None]
        if fq.mode != "bf16":
            o = o + (p * int8) @ v8[:, None]
            if fq.mode == "kv4":
                o = o + (p * int4) @ v4[:, None]
        out[:, :, rows] = o
    return out.reshape(hq, n, d).transpose(0, 1)[None].to(query.dtype), None


def register() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, fakequant_attention)
    return ATTENTION


def load_fakequant_model(path: str, device, dtype=None, state_dict: dict | None = None):
    from transformers import AutoModelForCausalLM

    device = torch.device(device)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=register())
    if state_dict is not None:
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
        if unexpected or len(missing) > 1:  # at most the tied LM head may be absent
            raise KeyError(f"checkpoint does not fit {path}: missing {missing[:4]}, unexpected {unexpected[:4]}")
    return model.to(device).eval()


# ---- streams and their engine schedule ----


@dataclass
class SampledStream:
    """A token stream as the engine computed it: ``first`` prompt tokens (one extend), then per
    turn ``gen`` sampled tokens and ``appended`` tokens appended after them (0 after the last)."""

    token_ids: list[int]
    first: int
    turns: list[tuple[int, int]]
    logprobs: list[float | None]  # the sampler's logprob of each sampled token (None elsewhere)

    def schedule(self) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """``(step_start [N], is_decode [N], query positions of the sampled tokens)``: the first
        sampled token of a turn comes out of the extend that computed the prompt / observation;
        the others out of decode steps of their predecessors; the last one is pending until the
        next extend computes it together with the appended tokens."""
        n = len(self.token_ids)
        start = torch.arange(n)
        dec = torch.zeros(n, dtype=torch.bool)
        start[: self.first] = 0
        pos, queries = self.first, []
        for gen, app in self.turns:
            queries.extend(range(pos - 1, pos + gen - 1))
            dec[pos: pos + gen - 1] = True  # start[q] = q for decode tokens (already)
            start[pos + gen - 1: pos + gen + app] = pos + gen - 1
            pos += gen + app
        return start, dec, queries


def sampled_positions(stream: SampledStream) -> list[int]:
    pos, out = stream.first, []
    for gen, app in stream.turns:
        out.extend(range(pos, pos + gen))
        pos += gen + app
    return out


@torch.inference_mode()
def teacher_forced_logprobs(model, stream: SampledStream, mode: str, sink: int = 0, recent: int = 0) -> torch.Tensor:
    """Log-softmax ``[Q, V]`` (float32) at the query positions of the sampled tokens."""
    from trainer_masks.scoring.lm_head import decoder, fp32_logits

    dev = next(model.parameters()).device
    start, dec, queries = stream.schedule()
    fq = FakeQuant(mode, sink, recent, start.to(dev), dec.to(dev))
    ids = torch.tensor(stream.token_ids, device=dev)[None]
    pos = torch.arange(len(stream.token_ids), device=dev)[None]
    hidden = decoder(model)(input_ids=ids, position_ids=pos, use_cache=False,
                            attention_mask={"full_attention": None, "sliding_attention": None},
                            fq=fq).last_hidden_state[0]
    logits = fp32_logits(model, hidden[torch.tensor(queries, device=dev)])
    return torch.log_softmax(logits, dim=-1)


def sample_streams(eng, renderer, episodes: list[dict], *, max_new_tokens: int, seed: int = 0,
                   temperature: float = 1.0) -> list[SampledStream]:
    """Play the recorded episodes' texts on ``eng``: the model samples every command (all
    episodes batched per turn), the recorded answer is appended."""
    from kvstreams_sglang.engine import SamplingParams

    states = []
    for ep in episodes:
        first = renderer.first_message(ep["text"]["first"]) + renderer.assistant_header()
        states.append(dict(sid=eng.open_stream(first), first=len(first), turns=[], text=ep["text"]["turns"]))
    for t in range(max(len(s["text"]) for s in states)):
        live = [s for s in states if t < len(s["text"])]
        gens = eng.generate_many([(s["sid"], SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                                            stop_token_ids=tuple(renderer.eos_ids),
                                                            seed=seed * 100_003 + 1009 * i + t))
                                  for i, s in enumerate(live)])
        for s, g in zip(live, gens, strict=True):
            obs = s["text"][t][1]
            app = [] if obs is None else (renderer.after_assistant(closed=g.finish_reason == "stop")
                                          + renderer.user_message(obs) + renderer.assistant_header())
            if app:
                eng.append(s["sid"], app)
            s["turns"].append((len(g.token_ids), len(app)))
    out = []
    for s in states:
        rec = eng.stream_record(s["sid"])
        eng.close(s["sid"])
        out.append(SampledStream(list(rec.token_ids), s["first"], s["turns"], list(rec.logprobs)))
    return out


def text_episodes(path: str | Path = DATA, n: int | None = None) -> list[dict]:
    import json

    eps = [e for e in json.loads(Path(path).read_text())["episodes"] if "text" in e]
    if n is not None:
        eps = [eps[i % len(eps)] for i in range(n)]
    return eps


def chained_episodes(episodes: list[dict], renderer, *, n: int, min_tokens: int) -> list[dict]:
    """``n`` long episodes, each recorded episodes played back to back until its game text alone (first message,
    observations, their chat framing) reaches ``min_tokens``: the sampled stream, commands included, is at least
    that long. The next game's opening text arrives as the observation after the previous game's last command.
    Chain ``i`` starts at episode ``i`` (cycling), so chains differ."""
    if not episodes:
        raise ValueError("chained_episodes: no recorded episodes with text")
    frame = len(renderer.assistant_header()) + len(renderer.after_assistant(closed=True))
    out = []
    for i in range(n):
        j = i
        first = episodes[j % len(episodes)]["text"]["first"]
        tokens = len(renderer.first_message(first)) + len(renderer.assistant_header())
        turns: list[list] = []
        while True:
            for cmd, obs in episodes[j % len(episodes)]["text"]["turns"]:
                turns.append([cmd, obs])
                if obs is not None:
                    tokens += len(renderer.user_message(obs)) + frame
            if tokens >= min_tokens:
                break
            j += 1
            nxt = episodes[j % len(episodes)]["text"]["first"]
            turns[-1][1] = nxt  # the game ended: the next one opens as an observation
            tokens += len(renderer.user_message(nxt)) + frame
        out.append({"text": {"first": first, "turns": turns}, "games": j - i + 1, "text_tokens": tokens})
    return out


def engine_check(model_path: str, fq_model, renderer, episodes: list[dict], device, *, max_new_tokens: int,
                 state_dict: dict | None = None, seed: int = 0) -> dict:
    """The engine's own logprobs (``bf16`` and ``kv4rl`` KV, 16 sink + 128 recent) against the
    fake-quant teacher-forced ones at the same tokens: max / mean |difference|."""
    from kvstreams_sglang.engine import Engine

    out = {}
    for kv, mode in (("bf16", "bf16"), ("kv4rl", "kv4")):
        eng = Engine(model_path, kv_dtype=kv, device=device, kv_slots=1 << 16, max_streams=8, sink=16, recent=128)
        if state_dict is not None:
            eng.update_weights(state_dict)
        streams = sample_streams(eng, renderer, episodes, max_new_tokens=max_new_tokens, seed=seed + 7)
        diffs, other = [], []
        for st in streams:
            pos = sampled_positions(st)
            sampled = torch.tensor([st.logprobs[p] for p in pos])
            for m, acc in ((mode, diffs), ("kv4" if mode == "bf16" else "bf16", other)):
                lp = teacher_forced_logprobs(fq_model, st, m, 16, 128)
                tf = lp.gather(1, torch.tensor([st.token_ids[p] for p in pos], device=lp.device)[:, None])[:, 0]
                acc.append((tf.cpu() - sampled).abs())
        d, o = torch.cat(diffs), torch.cat(other)
        out[kv] = dict(tokens=d.numel(), streams=len(streams), max_abs_diff=float(d.max()),
                       mean_abs_diff=float(d.mean()), stream_tokens=[len(s.token_ids) for s in streams],
                       turns=[len(s.turns) for s in streams],
                       # resolution: the same comparison against the other storage's teacher forcing
                       mean_abs_diff_vs_other_storage=float(o.mean()))
        del eng
    return out


def run(model_path: str, device, *, episodes: int = 24, max_new_tokens: int = 24, seed: int = 0,
        checkpoint: str | None = None, check_episodes: int = 2, progress=None, log=print,
        min_tokens: int | None = None, system_prompt: str | None = None) -> dict:
    """``min_tokens``: streams of at least that many tokens, recorded games played back to back
    (``chained_episodes``); ``check_episodes`` 0 skips the engine check; ``system_prompt``: the one the model
    was trained with (default: the TextWorld environment's)."""
    from transformers import AutoTokenizer

    from envs.rollout.chat import ChatRenderer
    from envs.textworld.env import SYSTEM_PROMPT
    from kvstreams_sglang.engine import Engine

    state_dict = None
    if checkpoint:
        from harness import checkpoint as ckpt

        state = ckpt.load_latest(checkpoint)
        if state is None:
            raise FileNotFoundError(f"no checkpoint in {checkpoint} (expected a 'latest' pointer: harness.checkpoint)")
        state_dict = state["trainer"]["model"]
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(model_path), system_prompt or SYSTEM_PROMPT)
    fq_model = load_fakequant_model(model_path, device, state_dict=state_dict)
    eps = chained_episodes(text_episodes(), renderer, n=episodes, min_tokens=min_tokens) if min_tokens \
        else text_episodes(n=episodes)
    slots = max(1 << 18, episodes * ((min_tokens or 0) + 64 * max_new_tokens) * 2)
    eng = Engine(model_path, kv_dtype="bf16", device=device, kv_slots=slots, max_streams=max(8, episodes))
    if state_dict is not None:
        eng.update_weights(state_dict)
    streams = sample_streams(eng, renderer, eps, max_new_tokens=max_new_tokens, seed=seed)
    del eng
    task = progress.add_task("D_sampler (teacher forcing)", total=len(streams)) if progress is not None else None
    kls: dict[str, list[torch.Tensor]] = {name: [] for name in CONFIGS}
    for st in streams:
        ref = teacher_forced_logprobs(fq_model, st, "bf16")
        for name, (mode, sink, recent) in CONFIGS.items():
            lq = teacher_forced_logprobs(fq_model, st, mode, sink, recent)
            kls[name].append((ref.exp() * (ref - lq)).sum(-1).cpu())
        if task is not None:
            progress.advance(task)
    rows = {}
    for name, parts in kls.items():
        k = torch.cat(parts).double()
        mode, sink, recent = CONFIGS[name]
        rows[name] = dict(mode=mode, sink=sink, recent=recent, prefixes=k.numel(), mean_kl=float(k.mean()),
                          sem_kl=float(k.std() / math.sqrt(max(1, k.numel() - 1))), median_kl=float(k.median()),
                          p99_kl=float(torch.quantile(k, 0.99)) if k.numel() else 0.0)
    ratio = rows["kv4_unprotected"]["mean_kl"] / max(rows["kv4_sink16_recent128"]["mean_kl"], 1e-30)
    # multi-turn episodes (several extends: prompt, then observation + last command token), shortest first
    multi = sorted((e for e in text_episodes() if len(e["text"]["turns"]) >= 3), key=lambda e: len(e["text"]["turns"]))
    check = engine_check(model_path, fq_model, renderer, (multi or eps)[:check_episodes], device,
                         max_new_tokens=max_new_tokens, state_dict=state_dict, seed=seed) if check_episodes else None
    lengths = [len(s.token_ids) for s in streams]
    log(f"D_sampler over {rows['kv8']['prefixes']} prefixes of streams of {min(lengths)}-{max(lengths)} tokens: "
        + ", ".join(f"{k} {v['mean_kl']:.2e}" for k, v in rows.items()) + f"; unprotected/protected {ratio:.2f}x"
        + (f"; engine check max |dlogprob| bf16 {check['bf16']['max_abs_diff']:.2e}, kv4rl "
           f"{check['kv4rl']['max_abs_diff']:.2e}" if check else ""))
    return dict(model_path=model_path, checkpoint=checkpoint, episodes=len(streams), min_tokens=min_tokens,
                games_per_stream=[e.get("games", 1) for e in eps],
                stream_tokens=dict(mean=statistics.fmean(lengths), max=max(lengths), min=min(lengths)),
                sampled_tokens=sum(g for s in streams for g, _ in s.turns), max_new_tokens=max_new_tokens,
                configs=rows, ratio_unprotected_over_protected=ratio, paper_ratio=7.0, engine_check=check)


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["configs"]
    names = list(rows)
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    ax.bar(range(len(names)), [rows[n]["mean_kl"] for n in names],
           yerr=[rows[n]["sem_kl"] for n in names], color="tab:purple", capsize=3)
    ax.set_xticks(range(len(names)), [n.replace("_", "\n", 1) for n in names], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("mean next-token KL(bf16 || quant)")
    ax.set_title(f"D_sampler over {rows[names[0]]['prefixes']} BF16-sampled prefixes; KV4 unprotected / "
                 f"16+128 protected = {result['ratio_unprotected_over_protected']:.2f}x (paper 7.0x)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

"""The trainer: FSDP2-wrapped policy, frozen reference, one optimizer step per batch.

``fully_shard`` on every decoder layer and on the root (one gloo process on CPU,
``torchrun`` + NCCL on GPUs, bf16 compute with fp32 reduction there). Records are
scored with ``trainer_masks.score_streams`` -- the same StreamRecords the sampler
produced, masks and positions included -- in micro-batches whose gradients accumulate
into one token-level mean over the whole batch.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from trainer_masks import EvictionEvent, StreamRecord
from trainer_masks.scoring import resolve_impl, score_streams
from trainer_masks.scoring.lm_head import decoder

from .config import TrainerConfig
from .loss import policy_loss, token_weights


@dataclass(frozen=True)
class TrainSample:
    record: StreamRecord
    advantage: float
    weight: float = 0.0  # the weight of each of its loss tokens in the global batch (``shard_batch`` sets it)


def shard_batch(samples: list[TrainSample], world: int, loss_norm: str) -> list[list[TrainSample]] | None:
    """The batch split over ``world`` data-parallel ranks before it reaches them: rank ``r`` scores
    ``samples[r::world]``, each sample carrying its tokens' weight in the *global* batch
    (``token_weights``), so every rank's loss is already a share of one global mean. Every rank
    gets the same number of samples (FSDP's collectives run once per forward): a short rank's
    padding is a zero-weight copy. None when the batch has no loss token."""
    lengths = [sum(s.record.loss_mask) for s in samples]
    if not sum(lengths):
        return None
    weighted = [dataclasses.replace(s, weight=w) for s, w in zip(samples, token_weights(lengths, loss_norm),
                                                                  strict=True)]
    per_rank = -(-len(weighted) // world)
    pad = dataclasses.replace(weighted[0], weight=0.0)
    return [weighted[r::world] + [pad] * (per_rank - len(weighted[r::world])) for r in range(world)]


def micro_batches(items: list, max_items: int, max_tokens: int | None = None, size=len) -> list[list]:
    """``items`` in order, packed greedily into forwards of at most ``max_items`` and (when given) ``max_tokens``
    tokens (``size(item)``); an item longer than ``max_tokens`` goes alone. Packing by tokens keeps a re-prefilled
    episode (a short record per compaction) from costing a forward per handful of windows."""
    out: list[list] = []
    tokens = 0
    for item in items:
        n = size(item)
        if not out or len(out[-1]) >= max_items or (max_tokens is not None and tokens + n > max_tokens):
            out.append([])
            tokens = 0
        out[-1].append(item)
        tokens += n
    return out


class WarmupSchedule:
    """The learning rate at each optimizer step: linear warm-up over ``warmup_steps``, then
    constant. Adam's first steps move every weight by about the full learning rate whatever the
    gradient's signal-to-noise (the moment estimates are one noisy sample): RL gradients are
    mostly noise, so full-size early steps drain probability from every sampled token."""

    def __init__(self, lr: float, warmup_steps: int):
        self.lr, self.warmup_steps = lr, warmup_steps

    def __call__(self, step: int) -> float:
        w = self.warmup_steps
        return self.lr * min(1.0, (step + 1) / w) if w else self.lr


METRIC_SUMS = ("mismatch_abs", "mismatch_kl_k3", "tis_clipped", "kl_ref", "tokens", "entropy", "onpolicy_mismatch_abs",
               "onpolicy_tokens")


def free_port(address: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def init_distributed(device: torch.device) -> None:
    """One process group: torchrun's when launched by it, else a single local process (on a
    free port, leaving the environment untouched so child processes start their own)."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if "RANK" in os.environ:
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    else:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def shard(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if device.type == "cuda" \
        else MixedPrecisionPolicy()
    for layer in decoder(model).layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


class Trainer:
    def __init__(self, model_path: str, config: TrainerConfig, device: torch.device):
        from transformers import AutoModelForCausalLM

        init_distributed(device)
        self.config, self.device = config, device
        load = dict(dtype=torch.float32)  # fp32 master weights; bf16 compute on GPU via FSDP's policy
        self.model = shard(AutoModelForCausalLM.from_pretrained(model_path, **load).to(device), device)
        self.ref = AutoModelForCausalLM.from_pretrained(model_path, **load).to(device).eval()
        if device.type == "cuda":
            self.ref.to(torch.bfloat16)
        self.ref.requires_grad_(False)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr, betas=config.betas,
                                           weight_decay=config.weight_decay)
        self.schedule = WarmupSchedule(config.lr, config.warmup_steps)
        self.step_count = 0

    def train_step(self, local: list[TrainSample]) -> dict[str, float]:
        """One optimizer step; ``local`` is this rank's shard of the batch (``shard_batch``): its
        forward/backward per micro-batch, then the step, then metrics reduced over the ranks.
        Each rank's loss is its share of the global token mean, scaled by the world size because
        FSDP averages gradients over ranks."""
        c = self.config
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums = dict.fromkeys(METRIC_SUMS, 0.0)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        for chunk in self.micro_batches(local):
            for k, v in self.forward_backward(chunk).items():
                sums[k] += v
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.grad_clip)
        lr = self.schedule(self.step_count)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.step_count += 1
        return self.reduce_metrics(sums, grad_norm, lr)

    @property
    def compiles(self) -> bool:
        """Its scoring compiles at first use: FlexAttention, ``torch.compile``d by transformers."""
        return resolve_impl(self.config.impl, self.device) == "flex"

    def warm_up(self) -> float:
        """Compile what a run's first steps would, before its clock starts (as its inference server is warmed): the
        policy's forward and backward and the reference's forward over two records of different lengths, each with
        an eviction (the second length makes ``torch.compile`` recompile with dynamic shapes, once). A run's first
        step otherwise carried ~12 s of FlexAttention compiles on a fresh H100 process (2026-12-06), whichever run
        came first. The records weigh 0 and no optimizer step follows: weights, optimizer, schedule and RNG are as
        before. Every rank calls it (FSDP). Returns its seconds."""
        t0 = time.perf_counter()
        cpu_rng = torch.random.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        self.model.train()
        vocab = self.model.config.vocab_size
        for n in (333, 777):
            record = StreamRecord(token_ids=[1 + i % (vocab - 1) for i in range(n)], positions=list(range(n)),
                                  sources=["env"] * n, loss_mask=[False] * n, logprobs=[None] * n,
                                  policy_versions=[None] * n, evictions=[EvictionEvent(at_index=n // 2,
                                                                                      spans=((16, n // 4),))])
            self.forward_backward([TrainSample(record, advantage=0.0, weight=0.0)])
        self.optimizer.zero_grad(set_to_none=True)
        torch.random.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, self.device)
        return time.perf_counter() - t0

    def micro_batches(self, local: list[TrainSample]) -> list[list[TrainSample]]:
        """This rank's forwards (``micro_batch_records``, ``micro_batch_tokens``). Packed by tokens, ranks can
        need different numbers of forwards, while FSDP's collectives run once per forward on every rank: the
        shorter ranks add forwards of a zero-weight record."""
        c = self.config
        chunks = micro_batches(local, c.micro_batch_records, c.micro_batch_tokens, size=lambda s: len(s.record))
        if c.micro_batch_tokens is not None and dist.get_world_size() > 1:
            most = torch.tensor([len(chunks)], device=self.device)
            dist.all_reduce(most, op=dist.ReduceOp.MAX)
            chunks += [[dataclasses.replace(local[0], weight=0.0)]] * (int(most) - len(chunks))
        return chunks

    def forward_backward(self, micro_batch: list[TrainSample]) -> dict[str, float]:
        """Score one micro-batch (policy and, for the KL term, reference), backward its share of the
        loss; returns its metric sums."""
        c = self.config
        world = dist.get_world_size()
        records = [s.record for s in micro_batch]
        scores = score_streams(self.model, records, impl=c.impl)
        if c.kl_coef:
            with torch.no_grad():
                ref_scores = score_streams(self.ref, records, impl=c.impl)
        else:  # no KL term: the reference forward would only feed a metric (kl_ref = 0)
            ref_scores = [dataclasses.replace(sc, logprobs=sc.logprobs.detach()) for sc in scores]
        lp, mu, ref, adv, tok_w, onpolicy = [], [], [], [], [], []
        entropy = 0.0
        padding = torch.zeros((), device=self.device)
        for s, sc, rs in zip(micro_batch, scores, ref_scores, strict=True):
            if s.weight == 0.0:
                padding = padding + sc.logprobs.sum() * 0.0  # runs FSDP's backward hooks, adds nothing
                continue
            rec = s.record
            idx = torch.tensor(rec.loss_mask, device=self.device).nonzero().squeeze(1)  # [M] loss tokens
            lp.append(sc.logprobs[idx])
            entropy += float(sc.entropy[idx].detach().sum())
            ref.append(rs.logprobs[idx])
            sampled = torch.tensor([x if x is not None else float("nan") for x in rec.logprobs], device=self.device)
            mu.append(sampled[idx])
            adv.append(torch.full((len(idx),), s.advantage, device=self.device))
            tok_w.append(torch.full((len(idx),), s.weight, device=self.device))
            # tokens sampled by the weights being trained now: their mismatch is the pure
            # sampler/trainer numeric gap (kernels, KV quantisation), no policy lag in it
            versions = torch.tensor([-1 if v is None else v for v in rec.policy_versions], device=self.device)
            onpolicy.append(versions[idx] == self.step_count)
        sums = dict.fromkeys(METRIC_SUMS, 0.0)
        if not lp:
            padding.backward()
            return sums
        terms = policy_loss(torch.cat(lp), torch.cat(mu), torch.cat(ref), torch.cat(adv), torch.cat(tok_w),
                            tis_cap=c.tis_cap, clip_eps=c.clip_eps, kl_coef=c.kl_coef)
        (terms.loss * world + padding).backward()
        sums.update(terms.sums)
        sums["entropy"] = entropy
        on = torch.cat(onpolicy)
        sums["onpolicy_mismatch_abs"] = float((torch.cat(lp).detach() - torch.cat(mu))[on].abs().sum())
        sums["onpolicy_tokens"] = float(on.sum())
        return sums

    def reduce_metrics(self, sums: dict[str, float], grad_norm: torch.Tensor, lr: float) -> dict[str, float]:
        """Per-token means over the global batch (sums all-reduced over the ranks)."""
        world = dist.get_world_size()
        if world > 1:
            keys = sorted(sums)
            t = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=self.device)
            dist.all_reduce(t)
            sums = dict(zip(keys, t.tolist(), strict=True))
        n = max(sums.get("tokens", 1.0), 1.0)
        out = {"lr": lr, "entropy": sums["entropy"] / n,
               "loss_tokens": n, "mismatch_abs": sums["mismatch_abs"] / n, "mismatch_kl": sums["mismatch_kl_k3"] / n,
               "tis_clip_frac": sums["tis_clipped"] / n, "kl_ref": sums["kl_ref"] / n,
               "grad_norm": float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)}
        if sums["onpolicy_tokens"]:
            out["onpolicy_mismatch_abs"] = sums["onpolicy_mismatch_abs"] / sums["onpolicy_tokens"]
        out["onpolicy_tokens"] = sums["onpolicy_tokens"]
        if self.device.type == "cuda":
            peak = torch.tensor([torch.cuda.max_memory_allocated(self.device) / 2**30], device=self.device)
            peaks = [torch.zeros_like(peak) for _ in range(world)]
            dist.all_gather(peaks, peak)
            out.update({f"trainer_peak_mem_gib_rank{r}": float(p) for r, p in enumerate(peaks)})
        return out

    def engine_weights(self) -> dict[str, torch.Tensor]:
        """Unsharded weights for the inference engine (a collective: every rank calls it).
        On GPUs they are gathered on the device (the engine copies them GPU to GPU); on CPU
        only rank 0 keeps a copy."""
        opts = StateDictOptions(full_state_dict=True, cpu_offload=self.device.type == "cpu")
        return get_model_state_dict(self.model, options=opts)

    def checkpoint_state(self) -> dict:
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return {"model": get_model_state_dict(self.model, options=opts),
                "optimizer": get_optimizer_state_dict(self.model, self.optimizer, options=opts),
                "step": self.step_count}

    def load_checkpoint_state(self, state: dict) -> None:
        opts = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.model, state["model"], options=opts)
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=opts)
        self.step_count = state["step"]

"""torchrun helper for test_data_parallel_fsdp2_step_equals_one_process: one train step (each rank scores its shard
of the batch), then rank 0 saves the weights."""

import sys

import torch

from harness.config import TrainerConfig
from harness.trainer import Trainer, TrainSample, shard_batch
from trainer_masks import StreamRecord


def samples() -> list[TrainSample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(5):  # odd on purpose: one rank gets fewer records
        n = 20 + 7 * i
        ids = torch.randint(0, 256, (n,), generator=g).tolist()
        src = ["prompt"] * 8 + ["model"] * (n - 8)
        lps = [None] * 8 + (-torch.rand(n - 8, generator=g) * 5).tolist()
        rec = StreamRecord(token_ids=ids, positions=list(range(n)), sources=src, loss_mask=[s == "model" for s in src],
                           logprobs=lps, policy_versions=[None] * 8 + [0] * (n - 8),
                           evictions=[dict(at_index=n - 3, spans=[(2, 6)])])
        out.append(TrainSample(rec, advantage=(-1.0) ** i * (i + 1) / 3))
    return out


if __name__ == "__main__":
    model_path, out_path = sys.argv[1], sys.argv[2]
    # packed by tokens too: rank 0's records (20, 34, 48 tokens) take 2 forwards, rank 1's (27, 41 and a padding
    # copy of 20) take 3, so rank 0 must add one of its own for FSDP's collectives to meet
    config = TrainerConfig(lr=1e-2, micro_batch_records=2, micro_batch_tokens=60, impl="sdpa")
    trainer = Trainer(model_path, config, torch.device("cpu"))
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    metrics = trainer.train_step(shard_batch(samples(), world, trainer.config.loss_norm)[rank])
    state = trainer.engine_weights()
    # the step's global gradient (kept after the step: the next one zeroes it), gathered from the shards
    grads = {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
             for name, p in trainer.model.named_parameters(remove_duplicate=False) if p.grad is not None}
    if torch.distributed.get_rank() == 0:
        torch.save({"state": state, "grads": grads, "metrics": metrics}, out_path)
    # both ranks tear the group down together: rank 1 destroying it while rank 0 still saved once aborted at exit
    # ("terminate called without an active exception", a gloo thread left joinable; CI, 2026-12-07)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()

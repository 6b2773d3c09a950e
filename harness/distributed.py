"""Several trainer processes under ``torchrun``; one orchestrator and one engine.

prime-rl runs trainer and inference as separate process groups. Here every trainer rank
is a ``torchrun`` process; rank 0 also runs the orchestrator and the inference engine
(on its own device, ``inference.device``, e.g. ``cuda:1`` of a two-GPU host where it
sits beside trainer rank 1). The other ranks *follow*: each trainer call rank 0 makes
(train step, weight gather for the engine, checkpoint) is first announced on a gloo
side group, so every rank enters the same FSDP collectives in the same order, whichever
thread rank 0 makes it from. A single process (CPU tests, one GPU) uses the same code
with no announcements.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist

from .trainer import Trainer, TrainSample, shard_batch


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def trainer_device(inference_device: torch.device) -> torch.device:
    """Under torchrun on GPUs each rank trains on ``cuda:LOCAL_RANK``; a single process
    trains where it infers."""
    if launched_by_torchrun() and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return inference_device


def on_device(device: torch.device):
    """CUDA's current device is per thread: make it the trainer's for the calls below, so
    Triton/NCCL launches land where the tensors are."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


class TrainerRanks:
    """Rank 0's handle on the trainer ranks: the ``Trainer`` calls, each announced first. A train
    step's batch is sharded here (``shard_batch``) and each rank receives only its share."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.world = dist.get_world_size()
        # every rank creates the side group, in the same order (new_group is collective)
        self.side_group = dist.new_group(backend="gloo") if self.world > 1 else None

    def _announce(self, verb: str, payload: Any = None) -> None:
        if self.side_group is not None:
            dist.broadcast_object_list([(verb, payload)], src=0, group=self.side_group)

    def _call(self, verb: str, fn: Callable, *args):
        with on_device(self.trainer.device):
            self._announce(verb, args[0] if args else None)
            return fn(*args)

    def train_step(self, samples: list[TrainSample]) -> dict[str, float]:
        shards = shard_batch(samples, self.world, self.trainer.config.loss_norm)
        if shards is None:
            return {"loss_tokens": 0.0}
        with on_device(self.trainer.device):
            self._announce("train")
            return self.trainer.train_step(scatter_shards(shards, self.side_group))

    def engine_weights(self) -> dict[str, torch.Tensor]:
        return self._call("weights", self.trainer.engine_weights)

    def warm_up(self) -> float:
        """The trainer's first-use compiles, on every rank, where its scoring has them (else 0 s)."""
        return self._call("warm_up", self.trainer.warm_up) if self.trainer.compiles else 0.0

    def checkpoint_state(self) -> dict:
        return self._call("checkpoint", self.trainer.checkpoint_state)

    def close(self) -> None:
        self._announce("stop")


def scatter_shards(shards: list[list[TrainSample]] | None, side_group) -> list[TrainSample]:
    """This rank's shard: rank 0 holds them all and sends each rank its own (ranks > 0 pass None)."""
    if side_group is None:
        return shards[0]
    box: list[Any] = [None]
    dist.scatter_object_list(box, shards, src=0, group=side_group)
    return box[0]


def follow(trainer: Trainer) -> None:
    """The loop of ranks > 0: do what rank 0 announces until it says stop."""
    side_group = dist.new_group(backend="gloo")
    calls = {"weights": trainer.engine_weights, "checkpoint": trainer.checkpoint_state, "warm_up": trainer.warm_up}
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=side_group)
        verb, payload = box[0]
        if verb == "stop":
            return
        with on_device(trainer.device):
            if verb == "train":
                trainer.train_step(scatter_shards(None, side_group))
            else:
                calls[verb](*(() if payload is None else (payload,)))

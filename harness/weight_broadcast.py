"""The trainer's end of SGLang's weight-update group: new weights broadcast to the server's ranks.

prime-rl, slime and the KV-streams authors move weights trainer -> inference over NCCL instead of a
file: the trainer is rank 0 of a process group whose other ranks are the server's tensor-parallel
ranks (SGLang's ``/init_weights_update_group``); each update announces names, dtypes and shapes
(``/update_weights_from_distributed``, ``flush_cache=False``: every stream keeps its KV) while rank
0 broadcasts the tensors in that order. Several servers (data parallel) join one group, server i's
ranks after server i-1's: one broadcast reaches them all. NCCL when the weights are on a GPU, gloo from a CPU (tests).
``join_group`` builds the group as SGLang's ``init_custom_process_group`` does on the server's side
(a TCP rendezvous, a store prefixed by the group name), without importing SGLang into the trainer.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta

import torch

from .trainer import free_port

GROUP_NAME = "kvstreams_weights"


def join_group(backend: str, address: str, port: int, world_size: int, rank: int, group_name: str,
               timeout: timedelta, join_timeout: timedelta = timedelta(seconds=120)):
    """A process group apart from the default one (the trainer's own ranks), joined at ``tcp://address:port``.
    ``join_timeout``: how long to wait for the other ranks (a server that refused the group never comes);
    ``timeout``: each collective's, once joined."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    store, rank, world_size = next(rendezvous(f"tcp://{address}:{port}", rank, world_size, timeout=join_timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                         group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def unique_tensors(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tied weights (lm_head = embeddings) once, under their first name, as a checkpoint holds them."""
    out, seen = {}, set()
    for name, t in state_dict.items():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            out[name] = t
    return out


class WeightBroadcast:
    """``clients``: one ``SGLangClient`` per server; ``server_ranks``: each server's TP x PP size (the group is
    ``1 + sum(server_ranks)`` processes). ``start`` joins the group, ``push`` sends one version."""

    def __init__(self, clients: list, *, address: str = "127.0.0.1", port: int = 0,
                 server_ranks: list[int] | None = None, timeout_s: float = 600.0):
        self.clients, self.address = list(clients), address
        ranks = list(server_ranks or [1] * len(self.clients))
        if len(ranks) != len(self.clients) or min(ranks) < 1:
            raise ValueError(f"server_ranks {ranks} do not describe {len(self.clients)} servers")
        self.rank_offsets = [1 + sum(ranks[:i]) for i in range(len(ranks))]
        self.port = port or free_port(address)
        self.world_size = 1 + sum(ranks)
        self.timeout = timedelta(seconds=timeout_s)
        self.group = None
        self.device: torch.device | None = None
        # one name per trainer process: a server keeps the group of a trainer that died without closing it, and
        # refuses a second group of the same name (a resumed run joins a new one)
        self.group_name = f"{GROUP_NAME}_{uuid.uuid4().hex[:12]}"

    async def start(self, device: torch.device) -> None:
        """``device``: where rank 0 sends from (the trainer's): NCCL from a GPU, gloo from the CPU."""
        self.device = device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        join = asyncio.to_thread(join_group, self.backend, self.address, self.port, self.world_size, 0,
                                 self.group_name, self.timeout)
        asks = [c.init_weights_update_group(self.address, self.port, self.world_size, group_name=self.group_name,
                                            backend=self.backend, rank_offset=offset)
                for c, offset in zip(self.clients, self.rank_offsets, strict=True)]
        self.group, *_ = await asyncio.gather(join, *asks)

    async def push(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        if self.group is None:
            raise RuntimeError("WeightBroadcast.push before start")
        weights = unique_tensors(state_dict)
        names = list(weights)
        dtypes = [str(t.dtype).removeprefix("torch.") for t in weights.values()]
        shapes = [list(t.shape) for t in weights.values()]

        def send() -> None:
            for t in weights.values():
                torch.distributed.broadcast(t.detach().to(self.device).contiguous(), src=0, group=self.group)

        await asyncio.gather(asyncio.to_thread(send), *(c.update_weights_from_distributed(
            names, dtypes, shapes, version, group_name=self.group_name) for c in self.clients))

    async def close(self) -> None:
        """Both ends leave the group (the server's through ``/destroy_weights_update_group``)."""
        if self.group is None:
            return
        try:
            await asyncio.gather(*(c.destroy_weights_update_group(self.group_name) for c in self.clients))
        finally:
            torch.distributed.destroy_process_group(self.group)
            self.group = None

"""The inference role: the built-in engine in-process, or an SGLang server over HTTP.

Both give the orchestrator the same ``EngineClient`` and take the trainer's weights without
touching any stream's KV: the built-in engine swaps tensors in place; SGLang loads them from
disk with ``flush_cache=False`` (its streams keep their KV in the radix tree). The weights travel as one
safetensors file written atomically under the run directory, the last two versions kept.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import torch

from envs.rollout.client import BuiltinClient

from . import checkpoint
from .config import InferenceConfig
from .distributed import trainer_device
from .weight_broadcast import WeightBroadcast, unique_tensors


class BuiltinInference:
    def __init__(self, cfg: InferenceConfig, model_path: str, device: torch.device):
        from kvstreams_sglang.engine import Engine

        self.engine = Engine.from_config(model_path, cfg, device=device,
                                         dtype=torch.float32 if device.type == "cpu" else None)
        self.client = BuiltinClient(self.engine)

    async def start(self) -> None:
        pass

    async def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        self.engine.update_weights(state_dict, version=version)

    def metrics(self) -> dict:
        return {}

    async def close(self) -> None:
        pass


class SGLangInference:
    """SGLang servers launched with ``--enable-kv-streams`` (and ``--kv4rl`` iff ``inference.kv_dtype =
    "kv4rl"``) on the same model as the trainer: one (``SGLangClient``), or several, data parallel
    (``StreamRouter``: each stream kept on one server, GRPO siblings together)."""

    def __init__(self, cfg: InferenceConfig, model_path: str, out: Path, trainer_device: torch.device | None = None):
        from kvstreams_sglang.sglang_ext.client import SGLangClient
        from kvstreams_sglang.sglang_ext.router import StreamRouter

        self.cfg, self.model_path = cfg, Path(model_path)
        urls = cfg.urls
        self.client = (SGLangClient(urls[0], kv_dtype=cfg.kv_dtype) if len(urls) == 1
                       else StreamRouter(urls, kv_dtype=cfg.kv_dtype))
        self.servers = getattr(self.client, "clients", [self.client])  # one SGLangClient per server
        self.weights_dir = out / "weights"
        self.trainer_device = trainer_device or torch.device("cpu")  # where broadcast weights are sent from
        self.broadcast: WeightBroadcast | None = None

    async def start(self) -> None:
        for server in self.servers:
            info = await server.pool_info()
            kv4 = info["pool"] == "KV4TokenToKVPool"
            if kv4 != (self.cfg.kv_dtype == "kv4rl"):
                raise RuntimeError(f"inference.kv_dtype = {self.cfg.kv_dtype!r} but the SGLang server at "
                                   f"{server.base_url} runs {info['pool']} (launch it "
                                   f"{'with' if not kv4 else 'without'} --kv4rl)")
            want = "bfloat16" if self.trainer_device.type == "cuda" else "float32"
            if info.get("model_dtype", want) != want:
                warnings.warn(f"the SGLang server at {server.base_url} computes in {info['model_dtype']} but the "
                              f"trainer in {want}: sampler and trainer logprobs differ by more than they need to "
                              f"(SGLang's --dtype auto runs an fp32 checkpoint in float16; launch with --dtype {want})",
                              stacklevel=2)
        if self.cfg.weight_sync == "distributed" and self.broadcast is None:
            ranks = []
            for server in self.servers:
                info = await server.server_info()
                ranks.append(int(info.get("tp_size") or 1) * int(info.get("pp_size") or 1))
            self.broadcast = WeightBroadcast(self.servers, address=self.cfg.weight_sync_address,
                                             port=self.cfg.weight_sync_port, server_ranks=ranks)
            await self.broadcast.start(self.trainer_device)

    def _write(self, state_dict: dict[str, torch.Tensor], version: int) -> Path:
        from safetensors.torch import save_file

        target = self.weights_dir / f"v{version:06d}"
        tmp = self.weights_dir / f".v{version:06d}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for name in ("config.json", "generation_config.json"):
            if (self.model_path / name).exists():
                shutil.copy(self.model_path / name, tmp / name)
        weights = {k: v.detach().to("cpu").contiguous() for k, v in unique_tensors(state_dict).items()}
        save_file(weights, tmp / "model.safetensors")
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
        # this version and the one before it; a resumed run writes versions a crashed run had passed
        checkpoint.prune(sorted(self.weights_dir.glob("v*"), reverse=True), target, keep=2)
        return target

    async def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        if self.broadcast is not None:
            await self.broadcast.push(state_dict, version)
        else:
            await self.client.update_weights_from_disk(str(self._write(state_dict, version)), version)

    def metrics(self) -> dict:
        """Cumulative (``SGLangClient.stats``): turns served, turns of episodes carried across weight
        updates, kept tokens the server had lost when a turn arrived, prompt tokens of first turns
        served from the tree (GRPO siblings), streams restored after the server evicted them under
        memory pressure and the tokens those restores computed again."""
        out = {f"sglang_{k}": v for k, v in self.client.stats.items()}
        if len(self.servers) > 1:
            out.update({f"sglang_streams_opened_server{i}": n for i, n in enumerate(self.client.opened)})
        return out

    async def close(self) -> None:
        if self.broadcast is not None:
            await self.broadcast.close()
            self.broadcast = None
        await self.client.aclose()


def make_inference(cfg: InferenceConfig, model_path: str, device: torch.device, out: Path):
    if cfg.engine == "sglang":
        return SGLangInference(cfg, model_path, out, trainer_device=trainer_device(device))
    return BuiltinInference(cfg, model_path, device)

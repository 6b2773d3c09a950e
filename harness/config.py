"""Run configuration: pydantic models loaded from TOML, overridable from the command line.

prime-rl's style: every knob is a field, sections mirror the processes (model,
inference, environment, compaction, orchestrator, trainer, run), unknown keys and bad
values fail before anything starts. Overrides are dotted paths:
``python -m harness.run configs/textworld/sliding_window.toml --trainer.lr 2e-6``.
"""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from envs.registry import options_model
from envs.rollout.agent_loop import EpisodeConfig
from envs.rollout.compaction import CompactionConfig
from kvstreams_sglang.engine.config import EngineConfig


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TinyModelConfig(Section):
    num_layers: int = Field(2, ge=1)
    hidden_size: int = Field(64, ge=8)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int = Field(2, ge=1)
    head_dim: int = Field(128, ge=8)
    intermediate_size: int | None = None
    vocab: Literal["bytes", "bpe"] = Field("bytes", description="bytes: one token per byte; bpe: byte-level BPE "
                                           "learnt on the train split's expert episodes")
    vocab_size: int = Field(1024, ge=259, description="bpe: tokens incl. the 256 bytes and 3 specials")
    seed: int = 0

    @model_validator(mode="after")
    def _heads(self) -> TinyModelConfig:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads}): "
                             f"each KV head serves a group of query heads")
        return self


class ModelConfig(Section):
    path: str | None = Field(None, description="local Hugging Face checkpoint; None builds the tiny model below")
    tiny: TinyModelConfig = TinyModelConfig()
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"


class InferenceConfig(EngineConfig):
    """The built-in engine's settings (``EngineConfig``: KV dtype, pool size, streams, ...), plus which
    engine serves the rollouts and where. ``kv_dtype`` must match an SGLang server's ``--kv4rl``."""

    engine: Literal["builtin", "sglang"] = "builtin"
    url: str | list[str] | None = Field(None, description="SGLang server URL (engine = sglang); several (a list, or "
                                        "comma-separated): data parallel, each stream kept on one server")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$",
                        description="engine device; under torchrun e.g. cuda:2 (trainer ranks use cuda:LOCAL_RANK)")
    weight_sync: Literal["disk", "distributed"] = Field(
        "disk", description="engine = sglang: how the trainer's weights reach the server, with flush_cache=False "
        "either way: 'disk' (a safetensors file the server loads) or 'distributed' (broadcast over a process "
        "group with the server's ranks: SGLang's init_weights_update_group / update_weights_from_distributed; "
        "NCCL from a GPU trainer, gloo from a CPU one)")
    weight_sync_address: str = Field("127.0.0.1", description="weight_sync = distributed: the address the "
                                     "server's ranks reach the trainer at (rank 0 of the group)")
    weight_sync_port: int = Field(0, ge=0, le=65535, description="its port (0: a free one)")

    @property
    def urls(self) -> list[str]:
        """The SGLang servers, in order."""
        if not self.url:
            return []
        parts = self.url if isinstance(self.url, list) else self.url.split(",")
        return [u.strip() for u in parts if u.strip()]

    @model_validator(mode="after")
    def _url(self) -> InferenceConfig:
        if self.engine == "sglang" and not self.urls:
            raise ValueError("inference.engine = 'sglang' needs inference.url")
        if len(set(self.urls)) != len(self.urls):
            raise ValueError(f"inference.url lists a server twice: {self.urls}")
        if self.weight_sync == "distributed" and self.engine != "sglang":
            raise ValueError("inference.weight_sync = 'distributed' is for an SGLang server (engine = 'sglang'); "
                             "the built-in engine takes the weights in process")
        return self


class EnvironmentConfig(Section):
    name: Literal["toy", "textworld", "alfworld", "swe"] = "toy"
    options: dict[str, Any] = Field(default_factory=dict, description="environment-specific settings")
    train_split: str = "train"
    eval_split: str = "eval"
    num_eval: int = Field(16, ge=0)
    processes: int = Field(0, ge=0, description="step the environments in this many worker processes (0: in the "
                           "harness's own): one process steps ~200 TextWorld turns/s at most, whatever the GPU")

    @field_validator("options")
    @classmethod
    def _options(cls, options: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        """Checked against the environment's own options model now, not when the task set is
        built after the run directory, the model and the engine are."""
        if "name" in info.data:  # else the name's own error is reported
            options_model(info.data["name"]).model_validate(options)
        return options


class OrchestratorConfig(Section):
    group_size: int = Field(8, ge=1, description="rollouts per task (G)")
    groups_per_step: int = Field(4, ge=1, description="complete groups a trainer step takes (T)")
    oversubscription: float = Field(2.0, ge=1.0, description="groups kept running per group consumed")
    async_level: int = Field(3, ge=0, description="max policy lag of trained data")
    episode: EpisodeConfig = Field(EpisodeConfig(), description="every rollout's episode settings (turn cap, "
                                   "stream-length cap, sampling)")
    reprefill_on_update: bool = Field(False, description="after each weight update, recompute the KV of carried "
                                      "(unfinished) episodes under the new policy, as KV4-RL does; default: keep it")


Beta = Annotated[float, Field(ge=0, lt=1, description="an Adam moment's decay rate")]


class TrainerConfig(Section):
    lr: float = Field(1e-6, gt=0)
    warmup_steps: int = Field(0, ge=0, description="linear learning-rate warm-up (optimizer steps)")
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[Beta, Beta] = (0.9, 0.999)
    grad_clip: float = Field(1.0, gt=0)
    kl_coef: float = Field(0.001, ge=0)
    tis_cap: float = Field(5.0, gt=0, description="truncated importance sampling cap C")
    clip_eps: float = Field(0.2, gt=0)
    loss_norm: Literal["token", "sequence"] = Field(
        "token", description="token: every loss token of the batch weighs the same (DAPO); sequence: every rollout "
                             "weighs the same, its tokens share it (GRPO)")
    micro_batch_records: int = Field(4, ge=1, description="records packed per forward (attention is quadratic "
                                                          "in the packed length on the dense CPU path)")
    micro_batch_tokens: int | None = Field(None, ge=1, description="also caps a forward's packed tokens: a "
                                           "re-prefilled episode is a short record per window, so a forward of "
                                           "micro_batch_records of them alone leaves the GPU idle")
    impl: Literal["auto", "sdpa", "flex", "invariant"] = Field(
        "auto", description="attention for scoring: auto (flex on CUDA, sdpa on CPU), sdpa, flex, or invariant (the "
                            "batch-invariant kernels, with inference.batch_invariant)")


class RunConfig(Section):
    steps: int = Field(10, ge=1)
    time_budget_s: float | None = Field(
        None, gt=0, description="also stop after the first step at which the run's accumulated step time reaches "
        "this (rollouts, training and weight sync, wall-clock; held-out evaluation excluded): runs compared at the "
        "same budget")
    output_dir: str = "runs/default"
    checkpoint_every: int = Field(1, ge=1)
    drain_at_checkpoint: bool = Field(
        True, description="true: the rollout groups in flight finish before a checkpoint (and the evaluation that "
        "comes with one), so a resumed run trains on exactly the data of a run never stopped, at the cost of the "
        "drain's tail on the run's time (the pool empties like a synchronous wave); false: they pause in place, in "
        "flight engine calls returning, and go on after it; a run resumed from such a checkpoint starts them again")
    keep_checkpoints: int | None = Field(None, ge=1, description="newest checkpoints kept (default: all)")
    seed: int = 0


class EvaluationConfig(Section):
    """Held-out evaluation during RL: the policy plays the eval games with the run's KV dtype and compaction, at a
    checkpoint (the rollouts drained or paused, ``run.drain_at_checkpoint``: none runs meanwhile, and its time is not
    the run's): through a built-in engine of its own, or on the run's SGLang server (``on_server``)."""

    every: int = Field(0, ge=0, description="evaluate at the start, every this many trainer steps and after the "
                                            "last one (eval.jsonl); 0: never during RL")
    temperature: float = Field(0.0, ge=0, description="0: greedy")
    splits: list[str] | None = Field(None, min_length=1, description="eval splits, each capped at "
                                     "environment.num_eval games (default: [environment.eval_split])")
    on_server: bool = Field(True, description="inference.engine = sglang: play the eval games on the run's SGLang "
                            "server (rollouts stopped, holding the step's weights); false: on a built-in engine of "
                            "its own")


class Config(Section):
    model: ModelConfig = ModelConfig()
    inference: InferenceConfig = InferenceConfig()
    environment: EnvironmentConfig = EnvironmentConfig()
    compaction: CompactionConfig = CompactionConfig()
    orchestrator: OrchestratorConfig = OrchestratorConfig()
    trainer: TrainerConfig = TrainerConfig()
    run: RunConfig = RunConfig()
    evaluation: EvaluationConfig = EvaluationConfig()

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        c, i = self.compaction, self.inference
        if i.kv_dtype == "kv4rl" and c.budget is not None and i.sink + i.recent > c.budget:
            raise ValueError(f"inference.sink + inference.recent ({i.sink} + {i.recent}) exceeds compaction.budget "
                             f"({c.budget}): the INT8 side cache would hold the whole live context")
        if i.engine == "sglang" and self.orchestrator.reprefill_on_update:
            raise ValueError("orchestrator.reprefill_on_update needs inference.engine = 'builtin' (SGLang sessions "
                             "keep their KV across weight updates)")
        if i.batch_invariant != (self.trainer.impl == "invariant"):
            raise ValueError("inference.batch_invariant = true and trainer.impl = 'invariant' go together: the "
                             "logprobs match only when both sides run the batch-invariant kernels")
        if i.batch_invariant and i.kv_dtype != "bf16":
            raise ValueError("inference.batch_invariant needs inference.kv_dtype = 'bf16': the trainer cannot replay "
                             "INT4 rounding bit for bit")
        if i.batch_invariant and i.engine != "builtin":
            raise ValueError("inference.batch_invariant needs inference.engine = 'builtin' (SGLang's kernels are not "
                             "replayed bit for bit)")
        cap = self.orchestrator.episode.max_stream_tokens
        if c.budget is not None and c.budget > cap:
            raise ValueError(f"compaction.budget ({c.budget}) exceeds orchestrator.episode.max_stream_tokens ({cap})")
        o, running = self.orchestrator, running_episodes(self)
        if i.engine == "builtin" and i.max_streams < running:
            raise ValueError(f"inference.max_streams ({i.max_streams}) is below the {running} episodes the "
                             f"orchestrator keeps running (group_size {o.group_size} x ceil(groups_per_step "
                             f"{o.groups_per_step} x oversubscription {o.oversubscription}), one engine stream "
                             f"each): raise it or run fewer groups")
        return self


def running_episodes(cfg: Config) -> int:
    """Episodes, hence open engine streams, a run holds at once: the orchestrator keeps
    ``ceil(T x oversubscription)`` groups of ``G`` in flight (``Orchestrator.target_groups``),
    an episode holds one stream at a time (re-prefill closes before it reopens), and nothing
    else shares the run's engine (held-out evaluation builds its own, bounded by max_streams)."""
    o = cfg.orchestrator
    return o.group_size * math.ceil(o.groups_per_step * o.oversubscription)


class ConfigError(ValueError):
    """A configuration that cannot run; the message says which key and why."""


def check_machine(cfg: Config) -> None:
    """What the schema cannot know: whether this machine has the model checkpoint and the
    device the config names. Kept apart from validation so that a config validates anywhere
    (CI checks the GPU configs on a CPU box); a run calls it before it writes anything."""
    import torch

    if cfg.model.path is not None:
        path = Path(cfg.model.path)
        if not path.exists():
            raise ConfigError(f"model.path: {path} does not exist (a local Hugging Face checkpoint directory)")
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.path: {path} has no config.json (not a Hugging Face checkpoint directory)")
        try:
            model_type = json.loads((path / "config.json").read_text()).get("model_type")
        except (ValueError, AttributeError):
            model_type = None
        if not model_type:
            raise ConfigError(f"model.path: {path / 'config.json'} is not a Hugging Face model config (no model_type)")
    device = cfg.inference.device
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"inference.device: {device}, but torch.cuda.is_available() is False on this machine "
                              f"(no GPU, or a CPU-only torch); use 'cpu' or 'auto'")
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise ConfigError(f"inference.device: {device}, but this machine has {torch.cuda.device_count()} CUDA "
                              f"device(s)")


def _message(error: dict) -> str:
    """Pydantic's message, without the "Value error, " it puts before our own checks' text."""
    if error["type"] == "value_error":
        return str(error["ctx"]["error"])
    return error["msg"]


def _parse_value(text: str) -> Any:
    """A CLI value as TOML would read it (numbers, booleans, arrays), else a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """``["--trainer.lr", "2e-6", "--run.steps=3"]`` -> nested updates of ``data``."""
    items, i = [], 0
    while i < len(overrides):
        arg = overrides[i]
        if not arg.startswith("--"):
            raise ConfigError(f"expected --section.key, got {arg!r}")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(overrides):
                raise ConfigError(f"{arg} needs a value")
            key, value = arg[2:], overrides[i + 1]
            i += 2
        items.append((key, _parse_value(value)))
    for key, value in items:
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--{key}: {part} is not a section")
        node[leaf] = value
    return data


def load_config(path: str | Path | None, overrides: list[str] | None = None, *, schema: type[Config] = Config):
    """TOML file + dotted overrides -> ``schema`` (``Config``, or an extension of it such as the demo's)."""
    data: dict = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path} is not valid TOML: {e}") from None
    data = apply_overrides(data, overrides or [])
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        lines = [f"  {'.'.join(str(x) for x in err['loc'])}: {_message(err)}" if err["loc"] else f"  {_message(err)}"
                 for err in e.errors()]
        raise ConfigError(f"invalid config{f' {path}' if path else ''}:\n" + "\n".join(lines)) from None

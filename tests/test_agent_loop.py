"""The agent loop end to end on the built-in engine with a tiny model: every strategy in
both executions yields records the trainer scores exactly as they were sampled."""

import asyncio

import pytest
import torch
from scripted import FixedEnv
from transformers import AutoModelForCausalLM, AutoTokenizer

from envs.rollout.agent_loop import EpisodeConfig, run_episodes
from envs.rollout.chat import ChatRenderer
from envs.rollout.client import BuiltinClient
from envs.rollout.compaction import CompactionConfig
from envs.rollout.protocol import Task
from kvstreams_sglang.engine import Engine
from trainer_masks.scoring import stream_logprobs


@pytest.fixture(scope="module")
def hf_model(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


@pytest.mark.parametrize("execution", ["kv_streams", "reprefill"])
@pytest.mark.parametrize("strategy", ["summary", "markovian_thinker", "markovian_pick", "sliding_window"])
def test_every_strategy_and_execution_keeps_logprob_parity(strategy, execution, tiny_model_path, hf_model):
    engine = Engine(str(tiny_model_path), kv_slots=8192, max_streams=8)
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(tiny_model_path), FixedEnv.system_prompt)
    compaction = CompactionConfig(strategy=strategy, execution=execution, window_turns=3, stride=2,
                                  summary_max_tokens=6, pick_max_tokens=5)
    config = EpisodeConfig(max_turns=7, max_new_tokens=5)
    tasks = [Task(f"t{i}", "train") for i in range(2)]
    episodes = asyncio.run(run_episodes(BuiltinClient(engine), lambda: FixedEnv(obs_len=6), tasks, renderer,
                                        compaction, config))
    for ep in episodes:
        assert ep.stats.compactions > 0
        if execution == "kv_streams":
            assert len(ep.records) == 1 and ep.records[0].evictions and ep.stats.tokens_reprefilled == 0
        else:
            assert len(ep.records) == ep.stats.compactions + 1 and ep.stats.tokens_reprefilled > 0
        with torch.no_grad():
            scored = stream_logprobs(hf_model, ep.records, impl="sdpa")
        for record, lp in zip(ep.records, scored, strict=True):
            model = [i for i, s in enumerate(record.sources) if s == "model"]
            diff = (lp[model] - torch.tensor([record.logprobs[i] for i in model])).abs().max()
            assert float(diff) <= 1e-4
    assert engine.stats.tokens_reprefilled == 0  # the engine itself never recomputes a token

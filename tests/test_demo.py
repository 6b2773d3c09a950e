"""`make demo` (``harness.demo``) runs the main job end to end: model, games, held-out
evaluation, SFT on compacted expert episodes, async GRPO with kv4rl KV-streams, the table."""

import asyncio
import json
import os
from pathlib import Path

import pytest
from rich.console import Console

from envs.textworld.tasks import TextWorldConfig, TextWorldTasks
from harness.demo import STAGES, load_demo_config, report, run_demo
from harness.evaluate import kv_peaks
from trainer_masks import StreamRecord


@pytest.fixture(scope="module")
def tiny_demo(tmp_path_factory):
    """The default demo config at the smallest size: 2 SFT steps, 1 RL step, 2 eval episodes."""
    out = tmp_path_factory.mktemp("demo")
    games = tmp_path_factory.mktemp("games")
    cfg = load_demo_config(None, [
        "--run.output_dir", str(out / "run"), "--run.steps", "1", "--run.checkpoint_every", "1",
        "--model.tiny.num_layers", "1", "--model.tiny.hidden_size", "32",
        "--environment.options", f'{{presets = ["easy"], n_train = 4, n_eval = 2, max_steps = 3, '
                                 f'cache_dir = "{games}", progress = false}}',
        "--environment.num_eval", "2", "--orchestrator.group_size", "2", "--orchestrator.groups_per_step", "1",
        "--orchestrator.episode.max_turns", "3", "--orchestrator.episode.max_new_tokens", "4",
        "--inference.kv_slots", "8192",
        "--inference.max_streams", "16", "--sft.steps", "2", "--sft.episodes", "8", "--sft.episodes_per_step", "4",
        "--sft.check_every", "1", "--sft.stop_train_win_rate", "1.0", "--sft.check_games", "2",
        "--sft.probe_episodes", "4"])
    summary = asyncio.run(run_demo(cfg))
    return summary, out / "run"


def test_demo_reports_every_stage_with_episode_counts(tiny_demo):
    summary, out = tiny_demo
    assert list(summary["stages"]) == list(STAGES)
    for stage in summary["stages"].values():
        assert stage["episodes"] == 2 and 0 <= stage["wins"] <= 2 and stage["win_rate"] == stage["wins"] / 2
    console = Console(record=True, width=200)
    console.print(report(summary))
    text = console.export_text()
    for line in (*STAGES, "peak live KV (compacted)", "full context (no compaction)", "tokens re-prefilled"):
        assert line in text
    assert json.loads((out / "summary.json").read_text()) == summary
    assert [json.loads(x)["stage"] for x in (out / "eval.jsonl").read_text().splitlines()] == list(STAGES)
    for path in ("demo.png", "sft/metrics.jsonl", "sft/model/config.json", "rl/metrics.jsonl", "rl/metrics.png"):
        assert (out / path).exists(), path


def test_demo_never_reprefills_and_kv4_beats_bf16(tiny_demo):
    summary, _ = tiny_demo
    assert summary["tokens_reprefilled"] == {"rl": 0, "eval": 0}
    kv = summary["kv"]
    assert 0 < kv["peak"]["tokens"] <= kv["full_context"]["tokens"]
    assert kv["peak"]["kv4rl"] < kv["peak"]["bf16"]


def test_sft_lowers_the_held_out_expert_command_loss(tiny_demo):
    summary, _ = tiny_demo
    assert summary["expert_nll"]["after_sft"] < summary["expert_nll"]["before_sft"]


def test_sft_checks_the_train_games_for_its_early_stop(tiny_demo):
    summary, out = tiny_demo
    rows = [json.loads(x) for x in (out / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert 1 <= summary["sft_steps"] == len(rows) <= 2  # a 2-step cap; a win on both train games stops at step 1
    assert all(0 <= r["train_win_rate"] <= 1 for r in rows)  # checked every step (check_every 1)
    assert all(r["train_win_rate"] < 1 for r in rows[:-1])  # it went on only while short of the target


def test_kv_peaks_counts_the_keys_a_query_sees_under_evictions():
    # 10 tokens; [2, 6) evicted when 7 tokens were computed: query 6 saw 7 keys, query 9 sees 6
    record = StreamRecord(token_ids=list(range(10)), positions=list(range(10)), sources=["prompt"] * 10,
                          loss_mask=[False] * 10, logprobs=[None] * 10, policy_versions=[None] * 10,
                          evictions=[{"at_index": 7, "spans": [(2, 6)]}])
    assert kv_peaks(record) == (7, 10)


def test_sft_batches_take_whole_episodes_from_every_rendering():
    from harness.sft import batches

    def episode(tag: str, n_records: int) -> list[str]:
        return [f"{tag}.{j}" for j in range(n_records)]

    streams = [episode(f"s{i}", 1) for i in range(3)]  # KV-streams: one record per episode
    reprefill = [episode(f"r{i}", 5) for i in range(4)]  # re-prefill: a record per compaction
    out = batches([streams, reprefill], size=2, steps=6, seed=0, length=lambda r: 1)
    for parts in out:  # 2 episodes of each rendering (an epoch boundary may repeat one)
        assert len(parts) == 2 and all(r.startswith("s") for r in parts[0]) and len(parts[0]) == 2
        assert all(r.startswith("r") for r in parts[1])
    # unthinned (a large budget): an episode's records travel together
    whole = batches([[episode(f"s{i}", 5) for i in range(3)], reprefill], size=2, steps=2, seed=0, length=lambda r: 1)
    assert all(len(part) == 10 for parts in whole for part in parts)
    assert {r.split(".")[0] for parts in whole for r in parts[1]} == {f"r{i}" for i in range(4)}  # shuffled epochs
    # thinned: the re-prefilled part keeps a random subset (in order) within the KV-streams part's 2 tokens
    kept = [parts[1] for parts in out]
    assert all(len(part) == 2 for part in kept)
    for part in kept:  # in order: an episode's kept windows in stream order
        for tag in {r.split(".")[0] for r in part}:
            js = [int(r.split(".")[1]) for r in part if r.startswith(tag + ".")]
            assert js == sorted(js)
    assert len({r for part in kept for r in part}) > 4  # different records over the steps
    # by tokens: a long KV-streams record (7) buys the re-prefilled part up to 7 tokens of its 2-token windows
    long = batches([[["s"]] * 3, reprefill], size=1, steps=3, seed=0, length=lambda r: 7 if r == "s" else 2)
    assert all(len(parts[1]) == 3 for parts in long)


def test_sft_micro_batches_pack_records_by_count_and_tokens():
    from harness.trainer import micro_batches

    records = ["a" * n for n in (5, 5, 5, 20, 3, 3)]
    assert [len(b) for b in micro_batches(records, 4)] == [4, 2]
    assert [[len(r) for r in b] for b in micro_batches(records, 4, max_tokens=10)] == [[5, 5], [5], [20], [3, 3]]


class LoggedTasks(TextWorldTasks):
    """TextWorld tasks that append the calling process's pid to ``log`` at each ``tasks()`` (a module-level class:
    spawned workers unpickle it by name)."""

    def __init__(self, config: TextWorldConfig, log: Path):
        super().__init__(config)
        self.log = log

    def tasks(self, split: str):
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()}\n")
        return super().tasks(split)


def test_expert_episodes_played_in_processes_equal_those_played_in_one(tmp_path):
    """``expert_records(workers=N)`` plays chunks of episodes in spawned processes (TextWorld's step is CPU-bound
    Python under one lock); episode ``i`` is seeded ``seed + i`` wherever it plays, so the records -- detours,
    evictions, loss masks -- are those of one process, in episode order. The games are made once, in the calling
    process, before the workers start (workers each asking for them made the same missing games all at once)."""
    from transformers import AutoTokenizer

    from envs.rollout.agent_loop import EpisodeConfig
    from envs.rollout.chat import ChatRenderer
    from envs.rollout.compaction import CompactionConfig
    from harness.sft import SFTConfig, expert_records
    from kvstreams_sglang.checkpoints import build_tiny_model

    calls = tmp_path / "tasks_calls.txt"
    taskset = LoggedTasks(TextWorldConfig(presets=["easy"], n_train=2, n_eval=1, max_steps=8,
                                          cache_dir=tmp_path / "games", progress=False), calls)
    model = build_tiny_model(tmp_path / "m", num_layers=1, hidden_size=32, num_heads=1, num_kv_heads=1,
                             head_dim=32, intermediate_size=32)
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(model), taskset.make_env().system_prompt)
    compaction = CompactionConfig(strategy="sliding_window", execution="kv_streams", window_turns=2, stride=1)
    sft = SFTConfig(episodes=5, detour=0.5)
    episode = EpisodeConfig(max_turns=8, max_new_tokens=8)
    ticks = []

    def play(workers: int):
        (records,) = asyncio.run(expert_records(taskset, renderer, [compaction], episode, sft, seed=3,
                                                workers=workers, on_episode=lambda: ticks.append(workers)))
        return records

    many, one = play(2), play(1)  # processes first, on an empty game cache
    assert calls.read_text().split() == [str(os.getpid())] * 2  # the games asked for here alone, once per call
    assert ticks.count(1) == ticks.count(2) == 5
    fields = ("token_ids", "positions", "loss_mask", "evictions")
    assert [[[getattr(r, f) for f in fields] for r in ep] for ep in one] == \
        [[[getattr(r, f) for f in fields] for r in ep] for ep in many]
    assert any(r.evictions for ep in one for r in ep)  # the window compacted
    assert len({tuple(ep[0].token_ids) for ep in one}) > 2  # the episodes differ (games, detours)


class CountedTasks(TextWorldTasks):
    """Counts the environments made: one per game played live."""

    made = 0

    def make_env(self, expert: bool = False):
        CountedTasks.made += 1
        return super().make_env(expert)


def test_expert_episodes_replayed_under_other_renderings_equal_those_played_live(tmp_path):
    """An expert episode's game is played once and replayed for the other renderings (``envs.rollout.transcript``):
    the records -- tokens, positions, loss masks, evictions, rewards -- are those of playing each rendering live,
    and only one game is played per episode. Where a rendering leaves the recording (here the token cap ends the
    KV-streams episodes early, whose stream keeps counting across evictions, and not the re-prefilled ones), that
    rendering is played live: the same records again."""
    from transformers import AutoTokenizer

    from envs.rollout.agent_loop import EpisodeConfig
    from envs.rollout.chat import ChatRenderer
    from envs.rollout.compaction import CompactionConfig
    from harness.sft import SFTConfig, expert_records
    from kvstreams_sglang.checkpoints import build_tiny_model

    taskset = CountedTasks(TextWorldConfig(presets=["easy"], n_train=2, n_eval=1, max_steps=12,
                                           cache_dir=tmp_path / "games", progress=False))
    model = build_tiny_model(tmp_path / "m", num_layers=1, hidden_size=32, num_heads=1, num_kv_heads=1,
                             head_dim=32, intermediate_size=32)
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(model), taskset.make_env().system_prompt)
    window = dict(strategy="sliding_window", window_turns=2, stride=1)
    renderings = [CompactionConfig(**window, execution="kv_streams"), CompactionConfig(**window, execution="reprefill"),
                  CompactionConfig(strategy="full_context", execution="kv_streams")]
    sft = SFTConfig(episodes=4, detour=0.5)

    def seen(r: StreamRecord) -> list:  # all but the timings
        stats = {k: v for k, v in r.meta.get("stats", {}).items() if k in ("turns", "compactions")}
        return [r.token_ids, r.positions, r.sources, r.loss_mask, r.evictions,
                {k: v for k, v in r.meta.items() if k != "stats"}, stats]

    def play(episode: EpisodeConfig, rs: list) -> tuple[list, int]:
        CountedTasks.made = 0
        per = asyncio.run(expert_records(taskset, renderer, rs, episode, sft, seed=5))
        return [[[seen(r) for r in ep] for ep in eps] for eps in per], CountedTasks.made

    for cap, live_games in ((1 << 20, 4), (900, 8)):
        episode = EpisodeConfig(max_turns=12, max_new_tokens=8, max_stream_tokens=cap)
        together, made = play(episode, renderings)
        alone = [play(episode, [r])[0][0] for r in renderings]
        assert together == alone
        assert made == live_games  # one game per episode; with the cap, the re-prefill rendering's again
        assert any(r[4] for ep in together[0] for r in ep)  # the window evicted
        assert len({str(ep) for ep in together[1]}) > 2  # the episodes differ (games, detours)

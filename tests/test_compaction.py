"""Compaction strategies on scripted episodes: eviction patterns turn by turn, the
re-prefill cost N*r/(B-r) against zero for KV streams, and bounded live KV."""

import asyncio

import pytest
from scripted import FixedEnv, ScriptedClient
from transformers import AutoTokenizer

from envs.rollout.agent_loop import EpisodeConfig, run_episode
from envs.rollout.chat import ChatRenderer
from envs.rollout.compaction import CompactionConfig, parse_pick
from envs.rollout.compaction.markovian_pick import pick_instruction
from envs.rollout.compaction.summary import INSTRUCTION
from envs.rollout.protocol import Task

ACTION, SUMMARY, PICK_ANSWER = 8, 12, "[2]"
STRATEGIES = ["summary", "markovian_thinker", "markovian_pick", "sliding_window"]
WINDOW = {"summary": (10, 5), "markovian_thinker": (10, 5), "markovian_pick": (10, 5), "sliding_window": (10, 1)}


@pytest.fixture(scope="module")
def renderer(tiny_model_path):
    return ChatRenderer(AutoTokenizer.from_pretrained(tiny_model_path), FixedEnv.system_prompt)


def script(renderer):
    eos = renderer.eos_ids[0]

    def answer(sid, n, max_new_tokens):
        if max_new_tokens == 256:  # the summary request (summary_max_tokens)
            return [66] * (SUMMARY - 1) + [eos]
        if max_new_tokens == 48:  # the pick request (pick_max_tokens)
            return renderer.encode(PICK_ANSWER) + [eos]
        return [65] * (ACTION - 1) + [eos]

    return answer


def run(renderer, strategy, execution, turns, **cfg):
    max_turns, stride = WINDOW.get(strategy, (10, 5))
    compaction = CompactionConfig(strategy=strategy, execution=execution, window_turns=max_turns, stride=stride, **cfg)
    client = ScriptedClient(script(renderer))
    episode = asyncio.run(run_episode(client, FixedEnv(), Task("t", "train"), renderer, compaction,
                                      EpisodeConfig(max_turns=turns, max_stream_tokens=10**7)))
    return episode, client


def test_pick_answers_parse_or_fall_back():
    assert parse_pick("keep [2, 4] please", 5) == [1, 3]
    assert parse_pick("[]", 5) == []
    for bad in ("none", "[0]", "[6]", "[1, 'a']", "[1.5]"):
        assert parse_pick(bad, 5) is None


@pytest.mark.parametrize("strategy", STRATEGIES + ["full_context"])
def test_eviction_pattern_matches_the_strategy_turn_by_turn(renderer, strategy):
    episode, client = run(renderer, strategy, "kv_streams", turns=30)
    assert len(episode.records) == 1
    first_end = len(renderer.first_message("o" * 20))
    live, expected, summary_start = [], [], None
    for _, span in episode.turn_spans:  # replay the strategy's definition turn by turn
        live.append(span)
        if strategy == "full_context" or len(live) < 10:
            continue
        if strategy == "summary":  # one run: the first message's end (or the last summary) .. the instruction
            instruction = len(renderer.user_message(INSTRUCTION))
            start = first_end if not expected else summary_start
            expected.append(([(start, live[-1][1] + instruction)], 0))
            summary_start = live[-1][1] + instruction
            live = []
        elif strategy == "markovian_pick":
            band = live[:5]
            expected.append(([t for t in band if t != band[1]], 2))  # the model answered [2]; + the exchange
            live = [band[1], *live[5:]]
        else:
            stride = WINDOW[strategy][1]
            expected.append((live[:stride], 0))
            live = live[stride:]
    assert len(client.evictions) == len(expected)
    for (_, spans), (turns, extra) in zip(client.evictions, expected, strict=True):
        assert spans[: len(turns)] == turns and len(spans) == len(turns) + extra
    if strategy == "full_context":
        assert client.evictions == []
    assert episode.stats.pick_fallbacks == 0 and episode.stats.tokens_reprefilled == 0


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_reprefill_costs_n_r_over_b_minus_r_and_kv_streams_costs_nothing(renderer, strategy):
    turns = 60
    kv, _ = run(renderer, strategy, "kv_streams", turns)
    rp, _ = run(renderer, strategy, "reprefill", turns)
    first = len(renderer.first_message("o" * 20))
    turn = len(renderer.assistant_header()) + ACTION + len(renderer.after_assistant(closed=True)) \
        + len(renderer.user_message("x" * 20))
    pending = turn - len(renderer.assistant_header()) - ACTION + 1  # env answer + last sampled token
    max_turns, stride = WINDOW[strategy]
    budget = first + max_turns * turn  # B: context when the strategy fires
    if strategy == "summary":  # keeps the first message, the summary exchange's answer and the restated obs
        after = len(renderer.after_assistant(closed=True))
        exchange = len(renderer.assistant_header()) + SUMMARY + after
        restated = len(renderer.user_message("x" * 20))
        retained = first + exchange + restated
        # per cycle: a window of turns, the instruction, the summary and the restated observation
        added = turn * max_turns + len(renderer.user_message(INSTRUCTION)) + exchange + restated
        computed = first + exchange - (1 + after)  # the summary's last token, separator and restated obs are pending
    elif strategy == "markovian_pick":  # keeps the 2nd turn of the band; the flushed exchange is evicted too
        retained = first + (max_turns - stride + 1) * turn
        instruction = len(renderer.user_message(pick_instruction(["A" * (ACTION - 1)] * stride)))
        answer = len(renderer.assistant_header()) + len(renderer.encode(PICK_ANSWER)) + 1 \
            + len(renderer.after_assistant(closed=True))
        added = budget - retained + instruction + answer
        computed = retained  # the flush computed everything before the re-prefill
    else:
        retained = first + (max_turns - stride) * turn
        added = budget - retained
        computed = retained - pending
    n = kv.stats.env_tokens + kv.stats.tokens_generated  # tokens the episode added after the first message
    n_steady = n - (retained - first)  # the first window starts from the first message, not from r
    predicted = n_steady * computed / added
    print(f"{strategy}: re-prefilled {rp.stats.tokens_reprefilled} (predicted N*r/(B-r) = {predicted:.0f}, "
          f"r={computed}, B-r={added}, {rp.stats.compactions} compactions), kv_streams {kv.stats.tokens_reprefilled}")
    assert kv.stats.tokens_reprefilled == 0 and kv.stats.compactions == rp.stats.compactions > 0
    assert abs(rp.stats.tokens_reprefilled - predicted) <= computed  # whole compactions: one cycle of rounding


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_live_kv_stays_bounded_while_full_context_grows_linearly(renderer, strategy):
    short, _ = run(renderer, strategy, "kv_streams", 100)
    long, _ = run(renderer, strategy, "kv_streams", 200)
    assert long.stats.peak_live_tokens == short.stats.peak_live_tokens  # bounded: no growth with turns
    full100, _ = run(renderer, "full_context", "kv_streams", 100)
    full200, _ = run(renderer, "full_context", "kv_streams", 200)
    per_turn = (full200.stats.peak_live_tokens - full100.stats.peak_live_tokens) / 100
    assert per_turn > 40 and full200.stats.peak_live_tokens > 10 * long.stats.peak_live_tokens


def test_an_environment_can_bound_each_answer(tiny_model_path):
    """An environment with ``max_new_tokens()`` bounds the next assistant message (``protocol.answer_budget``),
    never above the episode config's own bound."""

    class Bounded(FixedEnv):
        def max_new_tokens(self):
            return 2 + self.t

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(tiny_model_path), FixedEnv.system_prompt)
    client = ScriptedClient(lambda sid, n, m: [65] * m)  # a model that always writes as much as it may
    ep = asyncio.run(run_episode(client, Bounded(obs_len=5, steps=4), Task("t", "train"), renderer,
                                 CompactionConfig(strategy="full_context"),
                                 EpisodeConfig(max_turns=10, max_new_tokens=4)))
    assert ep.stats.turns == 4 and ep.stats.tokens_generated == 2 + 3 + 4 + 4


def test_an_episode_that_fails_mid_game_still_closes_its_environment(renderer):
    """An environment holds a sandbox or a worker's game: an episode that raises must not leave it open."""

    class Failing(FixedEnv):
        closed = False

        def step(self, action):
            if self.t == 3:
                raise RuntimeError("the game crashed")
            return super().step(action)

        def close(self):
            self.closed = True

    env = Failing()
    client = ScriptedClient(script(renderer))
    with pytest.raises(RuntimeError, match="the game crashed"):
        asyncio.run(run_episode(client, env, Task("t", "train"), renderer, CompactionConfig(strategy="full_context"),
                                EpisodeConfig(max_turns=10)))
    assert env.closed

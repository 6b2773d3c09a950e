"""TextWorld: real games generated offline (every preset), won by the expert, deterministic by
seed, and played by a tiny model through the agent loop with every compaction strategy."""

from __future__ import annotations

import hashlib
import time
from collections import defaultdict
from pathlib import Path

import pytest
from env_loop import env_text, play_tiny

from envs.rollout.compaction import STRATEGIES
from envs.textworld.env import TextWorldEnv
from envs.textworld.generate import EXTENSIONS, GameSpec, generate_games
from envs.textworld.presets import PRESETS
from envs.textworld.tasks import TextWorldConfig, TextWorldTasks
from envs.textworld.text import compact, parse_action


def digest(story: Path) -> dict[str, str]:
    """SHA-256 of each of a game's files (story, JSON, Inform source)."""
    return {ext: hashlib.sha256(story.with_suffix(ext).read_bytes()).hexdigest() for ext in EXTENSIONS}


def story(task) -> Path:
    return Path(task.payload["path"])


@pytest.fixture(scope="session")
def sample(tmp_path_factory):
    """A game of every preset in each split (the games cycle through the presets), generated once per
    session on two workers (timed)."""
    config = TextWorldConfig(presets=list(PRESETS), n_train=len(PRESETS), n_eval=len(PRESETS), workers=2,
                             progress=False,
                             cache_dir=tmp_path_factory.mktemp("textworld"))
    taskset = TextWorldTasks(config)
    specs = taskset.specs("train") + taskset.specs("eval")
    start = time.perf_counter()
    generate_games(specs, config.cache_dir, workers=2, progress=False)
    seconds = time.perf_counter() - start
    return taskset, taskset.tasks("train") + taskset.tasks("eval"), seconds


def play_expert(env: TextWorldEnv, task, actions: list[str] | None = None) -> tuple[int, float, dict, list[str]]:
    """The expert's game (or ``actions``' when given): steps, return, last info and the commands."""
    env.reset(task)
    ret, played = 0.0, []
    while True:
        played.append(env.expert_action() if actions is None else actions[len(played)])
        result = env.step(played[-1])
        ret += result.reward
        if result.done:
            return len(played), ret, result.info, played


@pytest.mark.serial
def test_two_games_of_every_preset_generate_in_under_two_minutes_on_two_cores(sample):
    _, tasks, seconds = sample
    print(f"\ngenerated {len(tasks)} games ({', '.join(sorted({t.payload['preset'] for t in tasks}))}) "
          f"in {seconds:.1f}s on 2 workers")
    n = 2 * len(PRESETS)
    assert len(tasks) == n and {t.payload["preset"] for t in tasks} == set(PRESETS)
    assert len({digest(story(t))[".z8"] for t in tasks}) == n  # all different games
    assert seconds < 120


def test_expert_wins_every_game_of_the_sample(sample):
    """The expert wins every game; an environment made without it (RL's: no plan tracked, ~2.5x cheaper steps)
    plays the same commands to the same scores and win, and has no expert to ask."""
    taskset, tasks, _ = sample
    env, plain = taskset.make_env(expert=True), taskset.make_env()
    steps_by_preset = defaultdict(list)
    try:
        for task in tasks:
            steps, ret, info, actions = played = play_expert(env, task)
            assert info["won"], f"expert lost {task.task_id} after {steps} steps"
            # the return is the score fraction plus the win bonus (defaults: 1 and 1)
            assert ret == pytest.approx(info["score"] / info["max_score"] + 1.0)
            assert play_expert(plain, task, actions) == played and plain.expert_action() is None
            steps_by_preset[task.payload["preset"]].append(steps)
    finally:
        env.close()
        plain.close()
    print(f"\nexpert wins {len(tasks)}/{len(tasks)}; steps per preset:", dict(steps_by_preset))
    assert max(steps_by_preset["short"]) <= 6
    assert min(steps_by_preset["xlong"]) >= 30


def test_games_in_worker_processes_play_as_in_this_one(sample):
    """``environment.processes``: each game lives in a worker process (``envs.rollout.env_processes``), played
    through the same protocol -- the expert's commands give the same observations, rewards and end as here."""
    from envs.rollout.env_processes import ProcessTaskSet, RemoteEnv

    taskset, tasks, _ = sample
    remote_set = ProcessTaskSet(taskset, 2)
    try:
        for task in tasks[:4]:
            here, there = taskset.make_env(expert=True), remote_set.make_env(expert=True)
            assert isinstance(there, RemoteEnv) and there.system_prompt == here.system_prompt
            assert there.reset(task) == here.reset(task)
            while True:
                action = here.expert_action()
                assert there.expert_action() == action
                a, b = here.step(action), there.step(action)
                assert (a.observation, a.reward, a.done, a.info) == (b.observation, b.reward, b.done, b.info)
                if a.done:
                    break
            assert a.info["won"]
            here.close()
            there.close()
        assert sorted(w.envs for w in remote_set.workers) == [0, 0]  # closed there too
    finally:
        remote_set.close()
    assert not any(w.process.is_alive() for w in remote_set.workers)


def test_the_same_seed_makes_the_same_game_bytes(sample, tmp_path):
    """Regenerated alone, in a new process, a game is byte for byte the one the batch made
    (where its process had made other presets' games first)."""
    _, tasks, _ = sample
    chosen = [next(t for t in tasks if t.payload["preset"] == p) for p in ("short", "treasure")]
    again = generate_games([GameSpec(t.payload["preset"], t.split, t.payload["seed"]) for t in chosen], tmp_path,
                           workers=1, progress=False)
    for task, path in zip(chosen, again, strict=True):
        assert digest(path) == digest(story(task))
    other = next(t for t in tasks if t.payload["preset"] == "short" and t is not chosen[0])
    assert digest(story(other))[".z8"] != digest(again[0])[".z8"]


def test_eval_games_are_held_out_from_training():
    taskset = TextWorldTasks(TextWorldConfig(presets=list(PRESETS), n_train=1000, n_eval=256))
    train, held_out = taskset.specs("train"), taskset.specs("eval")
    assert {s.seed for s in train}.isdisjoint(s.seed for s in held_out)
    assert PRESETS["cooking"].settings_for("eval")["split"] == "test"  # unseen foods and preparations
    assert PRESETS["cooking"].settings_for("train")["split"] == "train"


def test_first_message_is_goal_then_room_without_interpreter_chrome(sample):
    taskset, tasks, _ = sample
    env = taskset.make_env()
    try:
        first = env.reset(next(t for t in tasks if t.payload["preset"] == "simple"))
    finally:
        env.close()
    goal, room = first.split("\n", 1)
    assert "TextWorld" in goal  # tw-simple's objective opens the game
    assert room.startswith("-= ") and "=-" in room.splitlines()[0]  # the room title follows the goal
    assert "$$$$" not in first and "\n\n" not in first and not any(line.startswith(">") for line in first.splitlines())


def test_invalid_commands_get_the_games_own_answer_and_no_reward(sample):
    taskset, tasks, _ = sample
    env = taskset.make_env()
    try:
        env.reset(tasks[0])
        answers = {a: env.step(a) for a in ("dance wildly", "", "take the moon", "a\x00b")}
    finally:
        env.close()
    assert answers["dance wildly"].observation == "That's not a verb I recognise."
    assert answers[""].observation == "I beg your pardon?"
    assert answers["take the moon"].observation == "You can't see any such thing."
    assert answers["a\x00b"].observation == "That's not a verb I recognise."  # a NUL would crash the interpreter
    assert all(r.reward == 0 and not r.done and not r.info["won"] for r in answers.values())


def test_step_cap_ends_an_unwon_episode(sample):
    _, tasks, _ = sample
    env = TextWorldEnv(max_steps=3)
    try:
        env.reset(tasks[0])
        results = [env.step("look") for _ in range(3)]
    finally:
        env.close()
    assert [r.done for r in results] == [False, False, True]
    assert results[-1].info["truncated"] and not results[-1].info["won"]


def test_reward_is_weighted_score_fraction_plus_win_bonus(sample):
    _, tasks, _ = sample
    env = TextWorldEnv(score_weight=2.0, win_bonus=0.5)
    try:
        _, ret, info, _ = play_expert(env, next(t for t in tasks if t.payload["preset"] == "cooking"))
    finally:
        env.close()
    assert info["won"] and info["max_score"] > 1
    assert ret == pytest.approx(2.0 * info["score"] / info["max_score"] + 0.5)


def test_admissible_commands_are_listed_when_asked(sample):
    _, tasks, _ = sample
    env = TextWorldEnv(list_commands=True)
    try:
        first = env.reset(tasks[0])
        result = env.step(env.expert_action())
    finally:
        env.close()
    assert "\nAvailable commands: " in first and "look" in result.info["admissible_commands"]


def test_parse_action_takes_the_first_command_line():
    assert parse_action("<think>go west?\nno</think>\n\n> Open the door\nthen go") == "Open the door"
    assert parse_action("  `take key`  ") == "take key"
    assert parse_action("go\x00 north\x1b") == "go north"
    assert parse_action("\\, open box\\") == ", open box"  # no interpreter escapes
    assert parse_action("<think>unfinished thought") == ""


def test_compact_drops_prompt_status_bar_restart_menu_and_blank_lines():
    screen = ("\nYou put the milk on the stove.\n\n\nYour score has just gone up by one point.\n\n"
              "                 *** The End ***\n\nWould you like to RESTART, RESTORE a saved game, QUIT or UNDO "
              "the last command?\n>                                   -= Kitchen =-7/9")
    assert compact(screen) == ("You put the milk on the stove.\nYour score has just gone up by one point.\n"
                               "*** The End ***")


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_tiny_model_plays_textworld_in_the_agent_loop(strategy, sample, tiny_model_path):
    taskset, tasks, _ = sample
    games = [t for t in tasks if t.payload["preset"] in ("short", "coin")][:2]
    episodes, tokenizer = play_tiny(tiny_model_path, taskset.make_env, TextWorldEnv.system_prompt, games, strategy)
    for task, ep in zip(games, episodes, strict=True):
        assert ep.finish_reason == "max_turns" and ep.stats.turns == 5 and not ep.won
        assert (ep.stats.compactions > 0) == (strategy != "full_context")
        first = env_text(ep.records[0], tokenizer)
        env = taskset.make_env()
        try:
            assert env.reset(task) in first  # the goal and first room open the stream
        finally:
            env.close()

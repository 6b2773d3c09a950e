"""ALFWorld: the release's 140 seen and 134 unseen evaluation games (and 200 training games)
rebuilt offline, solved by the hand-coded expert, capped cleanly, and played by a tiny model
through the agent loop with every compaction strategy, all on reused player processes."""

from __future__ import annotations

import json
import random
from collections import defaultdict
from pathlib import Path

import pytest
from env_loop import env_text, play_tiny

from envs.alfworld.data import RELEASE, GameFiles, GameLogic, source_root
from envs.alfworld.env import AlfWorldEnv
from envs.alfworld.expert import play_games
from envs.alfworld.tasks import AlfWorldConfig, AlfWorldTasks
from envs.rollout.compaction import STRATEGIES


@pytest.fixture(scope="session")
def alfworld(tmp_path_factory):
    """One task set (data extracted and rebuilt into a fresh cache) and its process pool for
    the whole session."""
    taskset = AlfWorldTasks(AlfWorldConfig(cache_dir=tmp_path_factory.mktemp("alfworld")))
    yield taskset
    taskset.close()


def sample(tasks: list, n: int = 20) -> list:
    """``n`` tasks, every task type in turn, each type's picks spread over its games."""
    by_type = defaultdict(list)
    for task in tasks:
        by_type[task.payload["task_type"]].append(task)
    spread = [(i / len(group), kind, i) for kind, group in by_type.items() for i in range(len(group))]
    return [by_type[kind][i] for _, kind, i in sorted(spread)[:n]]


def test_eval_splits_hold_140_seen_and_134_unseen_games_that_load(alfworld):
    seen, unseen, train = (alfworld.tasks(s) for s in ("eval_seen", "eval_unseen", "train"))
    assert (len(seen), len(unseen), len(train)) == (140, 134, 200)
    assert len(alfworld.tasks("eval")) == 274
    assert not {t.task_id for t in seen} & {t.task_id for t in unseen}
    logic = GameLogic.installed()
    for task in seen + unseen:
        game = json.loads(Path(task.payload["gamefile"]).read_text())
        traj = json.loads((Path(task.payload["gamefile"]).parent / "traj_data.json").read_text())
        assert game["pddl_domain"] == logic.domain  # rebuilt with the installed package's logic
        assert "(:goal" in game["pddl_problem"] and game["solvable"]
        assert task.payload["task_type"] == traj["task_type"]
    # Loading in TextWorld's PDDL engine (grounding included) is a second a game: the expert
    # tests below load 40 of them; `python -m envs.alfworld.expert` plays all 274 (minutes).


@pytest.mark.parametrize("split", ["eval_seen", "eval_unseen"])
def test_expert_solves_at_least_95_percent_of_a_20_game_sample(split, alfworld):
    """Solved = won before the expert gives up; some take it 50-100 commands (it searches
    receptacles one by one), more than the 50-step budget agents get, so that rate is printed."""
    games = sample(alfworld.tasks(split))
    results = play_games(alfworld, games)
    rate = sum(won for won, _ in results) / len(results)
    in_budget = sum(won and steps <= 50 for won, steps in results) / len(results)
    print(f"\n{split}: expert solves {rate:.0%} of {len(results)} games ({in_budget:.0%} within the standard "
          f"50-step budget); steps {sorted(steps for _, steps in results)}")
    assert len(results) == 20 and len({t.payload["task_type"] for t in games}) == 6
    assert rate >= 0.95


def test_random_policy_stops_cleanly_at_the_step_cap_and_the_process_is_reused(alfworld):
    tasks = alfworld.tasks("eval_unseen")
    env = AlfWorldEnv(alfworld.pool, max_steps=8)
    rng = random.Random(0)
    env.reset(tasks[0])
    results = []
    for _ in range(8):
        results.append(env.step(rng.choice(env.admissible_commands() + ["fly to the moon"])))
        if results[-1].done:
            break
    pid = env._proc.pid
    env.close()
    assert len(results) == 8 and [r.done for r in results] == [False] * 7 + [True]
    assert results[-1].info["truncated"] and not results[-1].info["won"]
    again = AlfWorldEnv(alfworld.pool)
    assert again.reset(tasks[1]).startswith("Your task is to:")
    assert again._proc.pid == pid  # the pool handed the same process back, warm
    again.close()


def test_first_message_is_the_goal_then_the_room_and_bad_commands_get_the_games_answer(alfworld):
    env = alfworld.make_env()
    try:
        first = env.reset(alfworld.tasks("eval_seen")[0])
        answers = [env.step(a) for a in ("dance", "put alarmclock 1 in/on desk 1", "")]
    finally:
        env.close()
    goal, room = first.split("\n")
    assert goal.startswith("Your task is to: ") and room.startswith("You are in the middle of a room.")
    assert "Welcome" not in first
    assert [a.observation for a in answers] == ["Nothing happens."] * 3  # the old grammar's verb is gone
    assert all(a.reward == 0 and not a.done for a in answers)


def test_alfworld_data_wins_over_the_archive_only_when_it_holds_the_release(tmp_path, monkeypatch, alfworld):
    extracted = alfworld.files.root
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path / "empty"))  # e.g. the default alfworld sets on import
    assert source_root(alfworld.files.cache_dir) == extracted
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / RELEASE).symlink_to(extracted)
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path / "data"))
    files = GameFiles(tmp_path / "cache")
    assert files.root == tmp_path / "data" / RELEASE
    assert len(files.trials("eval_unseen")) == 134 and not (tmp_path / "cache" / RELEASE).exists()


def test_every_machine_builds_the_same_games_whatever_the_global_random(tmp_path, monkeypatch, alfworld):
    """The goal's wording is one of its task type's templates, which the package draws from the global `random`:
    built unseeded, a CPU box's train games and the device's said "examine the book with the desklamp" and "look at
    book under the desklamp" (the expert episodes played on one did not match the other's games). Another cache
    from another source folder, after other draws, gives the same bytes, and the caller's `random` is untouched."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / RELEASE).symlink_to(alfworld.files.root)  # the device's $ALFWORLD_DATA
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path / "data"))
    first = {rel: Path(game).read_bytes() for rel, game in alfworld.files.games("train")[:40]}
    random.seed(1234)
    random.random()
    state = random.getstate()
    other = GameFiles(tmp_path / "cache")
    again = {rel: Path(game).read_bytes() for rel, game in other.games("train")[:40]}
    assert again == first
    assert random.getstate() == state
    assert all("UNKNOWN GOAL" not in json.loads(game)["grammar"] for game in first.values())  # a goal filled in


def test_train_variants_move_objects_within_the_room_and_the_expert_still_solves_them(tmp_path, alfworld):
    """Each train trial again with its objects placed elsewhere (``envs/alfworld/variants.py``): the same room, task
    and objects, each pickupable one in a receptacle that can contain it, the same bytes on every build, and games
    the expert still wins (a 6-variant sample, one per task type: at least 5)."""
    import re

    files = GameFiles(tmp_path / "cache", train_variants=2)
    files.root  # noqa: B018 -- extracted once, into this cache
    games = files.games("train")
    assert len(games) == 600 and files.version != alfworld.files.version
    originals = dict(games[:200])
    variants = games[200:]
    assert [vid for vid, _ in variants[:2]] == [f"{games[0][0]}#v1", f"{games[0][0]}#v2"]
    fact = re.compile(r"\((inReceptacle|objectAtLocation|receptacleAtLocation|receptacleType|objectType|canContain) "
                      r"(\S+) (\S+)\)")

    def facts(game):
        found = defaultdict(dict)
        init = json.loads(Path(game).read_text())["pddl_problem"].partition("(:goal")[0]
        for name, a, b in fact.findall(init):
            found[name][a] = b
        return found

    moved = 0
    for vid, game in variants[:40]:
        base, new = facts(originals[vid.split("#")[0]]), facts(game)
        assert new["objectType"] == base["objectType"] and new["receptacleAtLocation"] == base["receptacleAtLocation"]
        assert new["inReceptacle"].keys() == base["inReceptacle"].keys()
        problem = json.loads(Path(game).read_text())["pddl_problem"]
        for obj, recep in new["inReceptacle"].items():
            if recep != base["inReceptacle"][obj]:
                moved += 1
                assert new["objectAtLocation"][obj] == new["receptacleAtLocation"][recep]  # its location with it
                assert (f"(canContain {new['receptacleType'][recep]} {new['objectType'][obj]})" in problem)
    assert moved > 100  # objects do move (40 variants, ~25 objects each)
    again = GameFiles(tmp_path / "other", train_variants=2)
    assert Path(again.games("train")[200][1]).read_bytes() == Path(variants[0][1]).read_bytes()
    taskset = AlfWorldTasks(AlfWorldConfig(cache_dir=tmp_path / "cache", train_variants=2))
    tasks = [t for t in taskset.tasks("train") if "#v" in t.task_id]
    taskset.close()
    picked = sample(tasks, 6)
    results = play_games(alfworld, picked)
    assert len({t.payload["task_type"] for t in picked}) == 6
    assert sum(won for won, _ in results) >= 5, results


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_tiny_model_plays_alfworld_in_the_agent_loop(strategy, alfworld, tiny_model_path):
    games = alfworld.tasks("eval_seen")[:2]
    episodes, tokenizer = play_tiny(tiny_model_path, alfworld.make_env, AlfWorldEnv.system_prompt, games, strategy)
    for ep in episodes:
        assert ep.finish_reason == "max_turns" and ep.stats.turns == 5 and not ep.won
        assert (ep.stats.compactions > 0) == (strategy != "full_context")
        text = env_text(ep.records[0], tokenizer)
        assert "Your task is to: " in text and "You are in the middle of a room." in text
    assert alfworld.pool.size <= 2  # episodes reuse the pool's processes

"""The hand-coded expert (``AlfWorldEnv.expert_action``) played through whole games: how the environment's games are
checked to be solvable, by the tests on a sample and by ``python -m envs.alfworld.expert`` on every eval game."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from .env import AlfWorldEnv

EXPERT_STEPS = 200  # the expert's own limit (it gives up after 200 commands, as in AlfredExpert)


def play_expert(env: AlfWorldEnv, task) -> tuple[bool, int]:
    """One game to its end; ``look`` where the expert has no command. Returns (won, steps)."""
    env.reset(task)
    while True:
        action = env.expert_action()
        result = env.step(action if action is not None else "look")
        if result.done:
            return result.info["won"], result.info["steps"]


def play_games(taskset, games: list, *, workers: int = 2, max_steps: int = EXPERT_STEPS,
               on_game: Callable[[], None] | None = None) -> list[tuple[bool, int]]:
    """The expert on ``games`` up to ``max_steps``, on ``workers`` player processes, results in game order;
    ``on_game`` is called after each game."""

    def play(chunk):
        env = AlfWorldEnv(taskset.pool, max_steps=max_steps)
        try:
            out = []
            for t in chunk:
                out.append(play_expert(env, t))
                if on_game is not None:
                    on_game()
            return out
        finally:
            env.close()

    chunks = [games[i::workers] for i in range(workers)]
    with ThreadPoolExecutor(workers) as pool:
        played = list(pool.map(play, chunks))
    out: list[tuple[bool, int] | None] = [None] * len(games)
    for i, results in enumerate(played):
        out[i::workers] = results
    return out


def main(argv: list[str] | None = None) -> int:
    """Every game of the eval splits (minutes): the expert's win rate, overall and within the agents' 50 steps;
    exit status 1 if it solves fewer than 95% of a split."""
    from tqdm import tqdm

    from .tasks import AlfWorldConfig, AlfWorldTasks

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--splits", nargs="+", default=["eval_seen", "eval_unseen"])
    p.add_argument("--workers", type=int, default=2)
    a = p.parse_args(argv)
    taskset = AlfWorldTasks(AlfWorldConfig())
    ok = True
    try:
        for split in a.splits:
            games = taskset.tasks(split)
            with tqdm(total=len(games), desc=f"{split} (expert)", unit="game") as bar:
                results = play_games(taskset, games, workers=a.workers, on_game=lambda: bar.update(1))
            rate = sum(won for won, _ in results) / len(results)
            in_budget = sum(won and steps <= 50 for won, steps in results) / len(results)
            print(f"{split}: expert solves {rate:.1%} of all {len(results)} games ({in_budget:.1%} within 50 steps)")
            ok &= rate >= 0.95
    finally:
        taskset.close()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Turn lengths of real TextWorld episodes, for the rollout benchmarks (``bench.rollout_evidence``).

Plays real games (``envs.textworld``, generated offline by ``envs.textworld.generate``) with three
policies and records, per episode, the token counts the agent loop would put into an engine stream
(``envs.rollout.agent_loop.run_episode`` with the byte tokenizer of ``kvstreams_sglang.checkpoints`` and Qwen's
chat template, rendered by ``envs.rollout.chat.ChatRenderer``):

- ``first``: the first message (system prompt + first observation) and the first assistant header;
- per turn ``[action, obs]``: the assistant message (command + end-of-turn token; what the model
  samples) and what is appended after it (template separator + the game's answer + the next
  assistant header); the last turn's ``obs`` is 0 (the episode ended, nothing is appended).

Policies: ``expert`` (TextWorld's plan, re-planned every step), ``detour`` (the expert, but with
probability 0.5 a harmless ``look``/``inventory`` instead: what SFT warm-start episodes look like)
and ``random`` (a uniformly random admissible command; cut at ``--max-steps``, like a weak policy).

Usage (the committed ``bench/data/textworld_turns.json`` was made with the defaults)::

    python -m bench.textworld_lengths [--presets easy short simple cooking --games 8 --max-steps 20]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from tqdm import tqdm

DEFAULT_OUT = Path(__file__).parent / "data" / "textworld_turns.json"
POLICIES = ("expert", "detour", "random")
DETOURS = ("look", "inventory")


def _command_env(max_steps: int):
    """A ``TextWorldEnv`` that also tracks the admissible commands (for the random policy)
    without listing them in the observations."""
    from envs.textworld.env import TextWorldEnv

    class CommandTrackingEnv(TextWorldEnv):
        def _infos(self):
            infos = super()._infos()
            infos.admissible_commands = True
            return infos

        def admissible(self) -> list[str]:
            return list(self._state["admissible_commands"] or [])

    return CommandTrackingEnv(max_steps=max_steps)


def play(env, task, renderer, policy: str, rng: random.Random, keep_text: bool = False) -> dict:
    """One episode: token counts of the first message and of every turn, as the agent loop
    renders them (see the module docstring); with ``keep_text`` also the texts (first
    observation, then ``[command, observation]`` per turn, the last observation ``None``)."""
    header = len(renderer.assistant_header())
    observation = env.reset(task)
    first = len(renderer.first_message(observation)) + header
    turns, won, reward = [], False, 0.0
    text = dict(first=observation, turns=[])
    while True:
        if policy == "random":
            action = rng.choice(env.admissible() or ["look"])
        else:
            action = env.expert_action()
            if action is None or (policy == "detour" and rng.random() < 0.5):
                action = rng.choice(DETOURS)
        result = env.step(action)
        reward += result.reward
        n_action = len(renderer.encode(action)) + 1  # + end-of-turn token (the model closes its message)
        if result.done:
            won = bool(result.info.get("won"))
            turns.append([n_action, 0])
            text["turns"].append([action, None])
            break
        obs = len(renderer.after_assistant(closed=True)) + len(renderer.user_message(result.observation)) + header
        turns.append([n_action, obs])
        text["turns"].append([action, result.observation])
    episode = dict(task=task.task_id, preset=task.payload["preset"], policy=policy, won=won, reward=round(reward, 4),
                   first=first, turns=turns)
    if keep_text:
        episode["text"] = text
    return episode


def summarize(episodes: list[dict]) -> dict:
    def stats(xs):
        xs = sorted(xs)
        return dict(n=len(xs), mean=round(statistics.fmean(xs), 2), min=xs[0], p50=xs[len(xs) // 2], max=xs[-1])

    return dict(turns=stats([len(e["turns"]) for e in episodes]),
                first_tokens=stats([e["first"] for e in episodes]),
                action_tokens=stats([a for e in episodes for a, _ in e["turns"]]),
                obs_tokens=stats([o for e in episodes for _, o in e["turns"] if o]),
                episode_tokens=stats([e["first"] + sum(a + o for a, o in e["turns"]) for e in episodes]),
                generated_tokens=stats([sum(a for a, _ in e["turns"]) for e in episodes]))


def collect(presets: list[str], games: int, max_steps: int, seed: int = 0, cache_dir: Path | None = None,
            progress: bool = True, text_presets: tuple[str, ...] = (), text_games: int = 0) -> list[dict]:
    from envs.rollout.chat import ChatRenderer
    from envs.textworld.env import SYSTEM_PROMPT
    from envs.textworld.tasks import TextWorldConfig, TextWorldTasks
    from kvstreams_sglang.checkpoints import build_byte_tokenizer

    renderer = ChatRenderer(build_byte_tokenizer(), SYSTEM_PROMPT)
    tasks = []
    for preset in presets:  # one task set per preset: ``games`` games of each
        config = TextWorldConfig(presets=[preset], n_train=games, n_eval=0, progress=progress, cache_dir=cache_dir)
        tasks.extend(TextWorldTasks(config).tasks("train"))
    env = _command_env(max_steps)
    rng = random.Random(seed)
    episodes = []
    try:
        seen: dict[str, int] = {}
        for task in tqdm(tasks, desc="playing", unit="game", disable=not progress):
            preset = task.payload["preset"]
            seen[preset] = seen.get(preset, 0) + 1
            keep = preset in text_presets and seen[preset] <= text_games
            for policy in POLICIES:
                episodes.append(play(env, task, renderer, policy, rng, keep_text=keep))
    finally:
        env.close()
    return episodes


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=["easy", "short", "simple", "cooking"])
    p.add_argument("--games", type=int, default=8, help="games per preset (train split, first seeds)")
    p.add_argument("--max-steps", type=int, default=20, help="turn cap (the random policy mostly hits it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--text-presets", nargs="*", default=["easy", "short"],
                   help="keep the texts of these presets' episodes (the sampler-fidelity benchmark replays them)")
    p.add_argument("--text-games", type=int, default=4, help="games per text preset whose texts are kept")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    episodes = collect(a.presets, a.games, a.max_steps, a.seed, text_presets=tuple(a.text_presets),
                       text_games=a.text_games)
    cmd = (f"python -m bench.textworld_lengths --presets {' '.join(a.presets)} --games {a.games} "
           f"--max-steps {a.max_steps} --seed {a.seed} --text-presets {' '.join(a.text_presets)} "
           f"--text-games {a.text_games}")
    by_policy = {pol: summarize([e for e in episodes if e["policy"] == pol]) for pol in POLICIES}
    data = dict(command=cmd, tokenizer="byte-level (kvstreams_sglang.checkpoints), Qwen chat template",
                units="tokens; turns are [action (sampled, incl. end-of-turn), obs (appended after it, incl. the "
                      "next assistant header; 0 on the last turn)]; first = first message + assistant header",
                summary=dict(all=summarize(episodes), **by_policy), episodes=episodes)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(data, indent=None, separators=(",", ":")).replace('{"task"', '\n{"task"') + "\n")
    print(json.dumps(data["summary"]["all"], indent=1))
    print(f"{len(episodes)} episodes -> {a.out} ({time.perf_counter() - t0:.0f}s)")


if __name__ == "__main__":
    main()

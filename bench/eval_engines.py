"""One checkpoint's held-out games on both engines, side by side: the built-in engine and our SGLang server.

Why: the learning bench trusts that a policy plays the same on the SGLang server as on the built-in engine, where
its SFT was checked. On the first GPU run of ``--serving.engine sglang`` (2026-12-06) the SFT'd policy, 72% greedy
train wins on the built-in engine, won 0 of 64 held-out games on the server: SGLang ignored the stop tokens (sent
with ``ignore_eos``), so no command ever ended. This runs the config's held-out evaluation (greedy, the config's
compaction and KV dtype) on both and reports wins, turns and how many episodes played the same tokens; run it on a
checkpoint before spending device time on learning runs.

    python -m bench.eval_engines --config configs/demo_textworld.toml --model runs/demo/textworld/sft/model \\
        [--out bench/results/eval_engines_cpu.json] [--section.key value ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from harness import checkpoint
from harness.config import load_config

from .learning import LearningConfig, rollout_server


def episode_tokens(episode) -> list[list[int]]:
    return [list(r.token_ids) for r in episode.records]


async def play(cfg: LearningConfig, model: str, engine: str, log: Path) -> tuple[dict, list]:
    """The held-out evaluation on ``engine`` (``builtin`` or ``sglang``): its result and its episodes."""
    from transformers import AutoTokenizer

    from envs.registry import make_taskset
    from envs.rollout.chat import ChatRenderer
    from harness.evaluate import evaluate, held_out_tasks, make_engine
    from harness.run import resolve_device

    taskset = make_taskset(cfg.environment.name, cfg.environment.options)
    tasks = next(iter(held_out_tasks(taskset, cfg).values()))
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(model), taskset.make_env().system_prompt)
    kw = dict(temperature=0.0, seed=cfg.run.seed)
    if engine == "builtin":
        result, episodes = await evaluate(engine, make_engine(cfg, model, resolve_device(cfg.inference.device)),
                                          taskset, tasks, renderer, cfg, **kw)
        return result.as_dict(), episodes
    from kvstreams_sglang.sglang_ext.client import SGLangClient

    run_cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": model})})
    with rollout_server(run_cfg, cfg.serving, log) as server:
        client = SGLangClient(server.url, kv_dtype=cfg.inference.kv_dtype)
        try:
            result, episodes = await evaluate(engine, client, taskset, tasks, renderer, cfg, **kw)
        finally:
            await client.aclose()
    return result.as_dict(), episodes


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="other --section.key value arguments override the config")
    ap.add_argument("--config", required=True, help="TOML: the harness's sections (a learning or demo config)")
    ap.add_argument("--model", required=True, help="the checkpoint (a directory with its tokenizer)")
    ap.add_argument("--out", type=Path, help="JSON report (atomic)")
    ap.add_argument("--server-log", type=Path, default=Path("runs/eval_engines/server.log"))
    own, overrides = ap.parse_known_args(argv)
    cfg = load_config(own.config, overrides, schema=LearningConfig)
    log = own.server_log
    log.parent.mkdir(parents=True, exist_ok=True)
    results, played = {}, {}
    for engine in ("builtin", "sglang"):
        results[engine], played[engine] = asyncio.run(play(cfg, own.model, engine, log))
        print(f"{engine}: won {results[engine]['wins']}/{results[engine]['episodes']}, "
              f"{results[engine]['mean_turns']:.2f} turns on average")
    same = sum(episode_tokens(a) == episode_tokens(b) for a, b in zip(played["builtin"], played["sglang"],
                                                                      strict=True))
    report = dict(command="python -m bench.eval_engines " + " ".join(argv), model=own.model,
                  kv_dtype=cfg.inference.kv_dtype, device=cfg.inference.device,
                  compaction=cfg.compaction.model_dump(mode="json"), engines=results,
                  episodes_same_tokens=same, episodes=len(played["builtin"]),
                  wins_equal=results["builtin"]["wins"] == results["sglang"]["wins"])
    print(f"episodes with the same tokens on both engines: {same}/{len(played['builtin'])}")
    if own.out:
        checkpoint.atomic_write_bytes(own.out, json.dumps(report, indent=1).encode())
    return report


if __name__ == "__main__":
    main()

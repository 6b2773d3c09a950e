"""The async RL harness: configs, short runs per strategy, the lag bound, resume, learning."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from harness import checkpoint
from harness.config import load_config
from harness.loss import group_advantages, policy_loss, token_weights
from harness.run import main, run
from harness.trainer import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def small(tmp_path, name, *extra):
    return load_config(os.path.join(ROOT, "configs/demo.toml"), [
        "--run.output_dir", str(tmp_path / name), "--orchestrator.group_size", "2",
        "--orchestrator.groups_per_step", "2", "--orchestrator.episode.max_turns", "5", "--run.steps", "3",
        "--compaction.window_turns", "2", "--compaction.stride", "1", *extra])


needs_a_cpu_only_machine = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


@pytest.mark.parametrize("argv,message", [
    (["--compaction.strategy", "windowed"], "compaction.strategy"),
    (["--compaction.budget", "-1"], "compaction.budget"),
    (["--inference.kv_dtype", "kv4rl", "--compaction.budget", "100"], "sink + inference.recent"),
    (["--trainer.learning_rate", "1e-6"], "trainer.learning_rate: Extra inputs are not permitted"),
    (["--model.path", "/nonexistent"], "model.path: /nonexistent does not exist"),
    (["--model.path", "configs"], "model.path: configs has no config.json"),
    (["--model.tiny.num_heads", "3"], "model.tiny: num_heads (3) must be a multiple of num_kv_heads (2)"),
    pytest.param(["--inference.device", "cuda"], "inference.device: cuda, but torch.cuda.is_available() is False",
                 marks=needs_a_cpu_only_machine),
    (["--inference.device", "cuda:99"], "inference.device: cuda:99"),
    (["--trainer.betas", "[2,3]"], "trainer.betas.0: Input should be less than 1"),
    (["--trainer.betas", "[0.9,1.0]"], "trainer.betas.1: Input should be less than 1"),
    (["--trainer.betas", "[-0.1,0.9]"], "trainer.betas.0: Input should be greater than or equal to 0"),
    (["--environment.options.bogus", "1"], "environment.options.bogus: Extra inputs are not permitted"),
    (["--environment.options.rooms", "many"], "environment.options.rooms: Input should be a valid integer"),
    (["--environment.options.doors", "up"], "environment.options.doors"),
    (["--environment.name", "textworld", "--environment.options", "{bogus = 1}"],
     "environment.options.bogus: Extra inputs are not permitted"),
    (["--environment.name", "alfworld", "--environment.options", "{bogus = 1}"],
     "environment.options.bogus: Extra inputs are not permitted"),
    (["--environment.name", "swe", "--environment.options", "{workspaces = 'repos'}"],
     "environment.options.instances: Field required"),
    (["--inference.max_streams", "32"], "inference.max_streams (32) is below the 64 episodes"),
    (["--orchestrator.oversubscription", "2.1"], "inference.max_streams (64) is below the 72 episodes"),
    (["--inference.engine", "sglang"], "inference.engine = 'sglang' needs inference.url"),
    (["--inference.engine", "sglang", "--inference.url", "http://a:1,http://b:2,http://a:1"],
     "inference.url lists a server twice"),
])
def test_bad_config_fails_before_anything_starts(argv, message, capsys, tmp_path):
    """One line naming the key, exit status 2, and nothing written (no run directory)."""
    assert main(["configs/demo.toml", "--run.output_dir", str(tmp_path / "x"), "--run.steps", "1", *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_a_model_path_without_a_model_config_fails_before_anything_starts(tmp_path, capsys):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    assert main(["configs/demo.toml", "--run.output_dir", str(tmp_path / "x"), "--model.path",
                 str(tmp_path / "model")]) == 2
    assert "is not a Hugging Face model config (no model_type)" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_an_output_dir_that_cannot_be_created_fails_before_anything_starts(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert main(tiny_cli(tmp_path / "file" / "run")) == 2
    assert f"run.output_dir: cannot create {tmp_path / 'file' / 'run'}" in capsys.readouterr().err


def test_max_streams_equal_to_the_orchestrators_concurrency_is_enough():
    """configs/demo.toml keeps 8 x ceil(4 x 2.0) = 64 episodes running: 64 streams hold them."""
    from harness.config import running_episodes

    cfg = load_config(os.path.join(ROOT, "configs/demo.toml"))
    assert cfg.inference.max_streams == 64 == running_episodes(cfg)


def tiny_cli(out, *extra):
    """A one-step CLI run at the smallest size (a few seconds)."""
    return ["configs/demo.toml", "--run.output_dir", str(out), "--run.steps", "1", "--orchestrator.group_size", "2",
            "--orchestrator.groups_per_step", "1", "--orchestrator.episode.max_turns", "2",
            "--orchestrator.episode.env_in_thread",
            "false", "--no-overlap", *extra]


def metric_steps(out):
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_fresh_run_refuses_a_used_output_dir_unless_told_to_overwrite(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(tiny_cli(out)) == 0
    assert metric_steps(out) == [0]
    capsys.readouterr()
    assert main(tiny_cli(out)) == 2  # before: ran again and appended, steps [0, 0]
    err = capsys.readouterr().err
    assert f"run.output_dir {out} already holds a run" in err and "--resume" in err and "--overwrite" in err
    assert metric_steps(out) == [0]
    assert main(tiny_cli(out, "--overwrite")) == 0
    assert metric_steps(out) == [0]


def test_overwrite_refuses_to_clear_a_directory_that_is_not_a_run(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert main(tiny_cli(tmp_path, "--overwrite")) == 2
    assert "not a run directory" in capsys.readouterr().err and (tmp_path / "notes.txt").exists()


@pytest.mark.parametrize("prepare", ["missing dir", "empty dir", "no checkpoints"])
def test_resume_without_a_checkpoint_says_so_and_fails(prepare, tmp_path, capsys):
    out = tmp_path / "run"
    if prepare != "missing dir":
        out.mkdir()
    if prepare == "no checkpoints":
        (out / "metrics.jsonl").write_text("")
        (out / "checkpoints").mkdir()
    assert main(tiny_cli(out, "--resume")) == 2  # before: started silently at step 0
    assert f"--resume: no checkpoint in {out / 'checkpoints'}" in capsys.readouterr().err
    assert not (out / "config.json").exists()


def test_resume_and_overwrite_exclude_each_other(tmp_path, capsys):
    assert main(tiny_cli(tmp_path / "run", "--resume", "--overwrite")) == 2
    assert "--resume and --overwrite" in capsys.readouterr().err


def save_checkpoints(directory, steps):
    from harness import checkpoint

    for step in steps:
        checkpoint.save(directory, step, {"trainer": {"w": torch.full((64,), float(step))}, "orchestrator": {}})


CORRUPTIONS = {
    "truncated": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    "garbage bytes": lambda p: p.write_bytes(os.urandom(4096)),
    "a pickle frame of 2**62 bytes": lambda p: p.write_bytes(b"\x80\x04\x95" + (2**62).to_bytes(8, "little")),
    "empty": lambda p: p.write_bytes(b""),
    "a directory": lambda p: (p.unlink(), p.mkdir()),
    "missing": lambda p: p.unlink(),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_corrupt_latest_checkpoint_falls_back_to_the_newest_intact_one(corruption, tmp_path, caplog):
    from harness import checkpoint

    save_checkpoints(tmp_path, [2, 4, 6])
    bad = tmp_path / "step_000006.pt"
    CORRUPTIONS[corruption](bad)
    with caplog.at_level("WARNING", logger="harness.checkpoint"):
        state = checkpoint.load_latest(tmp_path)
    assert state["step"] == 4 and state["trainer"]["w"][0] == 4
    assert f"checkpoint {bad} " in caplog.text  # the file is named, with what is wrong with it
    assert f"falling back to {tmp_path / 'step_000004.pt'}" in caplog.text


@pytest.mark.parametrize("corruption", ["truncated", "a directory"])
def test_a_run_resumed_below_a_damaged_checkpoint_keeps_what_it_saves(corruption, tmp_path):
    """Resumed from step 4 (step 6 damaged), the run saves step 5 with keep=1: step 5 is kept and loads, and the
    cut run's step 6 is gone (it sorted above step 5 and would have been "the newest one")."""
    from harness import checkpoint

    save_checkpoints(tmp_path, [2, 4, 6])
    CORRUPTIONS[corruption](tmp_path / "step_000006.pt")
    assert checkpoint.load_latest(tmp_path)["step"] == 4
    checkpoint.save(tmp_path, 5, {"trainer": {}, "orchestrator": {}}, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000005.pt"]
    assert checkpoint.load_latest(tmp_path)["step"] == 5


@pytest.mark.parametrize("pointer", ["step_000009.pt", "", "../../etc/passwd", "a directory"])
def test_a_bad_latest_pointer_falls_back_to_the_newest_intact_checkpoint(pointer, tmp_path, caplog):
    from harness import checkpoint

    save_checkpoints(tmp_path, [2, 4])
    latest = tmp_path / "latest"
    if pointer == "a directory":
        latest.unlink()
        latest.mkdir()
    else:
        latest.write_text(pointer)
    with caplog.at_level("WARNING", logger="harness.checkpoint"):
        state = checkpoint.load_latest(tmp_path)
    assert state["step"] == 4
    assert f"{latest}" in caplog.text and f"falling back to {tmp_path / 'step_000004.pt'}" in caplog.text


def test_no_checkpoint_is_none_and_only_corrupt_ones_an_error_naming_each(tmp_path):
    from harness import checkpoint

    assert checkpoint.load_latest(tmp_path / "absent") is None
    save_checkpoints(tmp_path, [2, 4])
    for step, corruption in ((2, "truncated"), (4, "garbage bytes")):
        CORRUPTIONS[corruption](tmp_path / f"step_{step:06d}.pt")
    with pytest.raises(checkpoint.CorruptCheckpoint, match=f"no intact checkpoint in {tmp_path}") as e:
        checkpoint.load_latest(tmp_path)
    assert str(tmp_path / "step_000002.pt") in str(e.value) and str(tmp_path / "step_000004.pt") in str(e.value)


def test_resume_from_only_corrupt_checkpoints_names_them_and_fails(tmp_path, capsys):
    out = tmp_path / "run"
    save_checkpoints(out / "checkpoints", [1])
    CORRUPTIONS["truncated"](out / "checkpoints" / "step_000001.pt")
    assert main(tiny_cli(out, "--resume")) == 2
    err = capsys.readouterr().err
    assert f"checkpoint {out / 'checkpoints' / 'step_000001.pt'} " in err
    assert f"--resume: no intact checkpoint in {out / 'checkpoints'}" in err


def test_group_advantages_are_normalised_within_the_group():
    adv = group_advantages([1.0, 0.0, 0.0, 1.0])
    assert adv == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)
    assert group_advantages([0.5, 0.5]) == [0.0, 0.0]


def test_policy_loss_truncates_importance_weights_and_counts_clips():
    lp = torch.tensor([-1.0, -1.0, -2.0], requires_grad=True)
    mu = torch.tensor([-1.0, -4.0, -2.0])  # token 2: pi/mu = e^3 > C = 5
    terms = policy_loss(lp, mu, lp.detach(), torch.tensor([1.0, 1.0, -1.0]), torch.full((3,), 1 / 3), tis_cap=5.0,
                        clip_eps=0.2, kl_coef=0.0)
    terms.loss.backward()
    assert terms.sums["tis_clipped"] == 1
    assert lp.grad.tolist() == pytest.approx([-1 / 3, -5 / 3, 1 / 3])  # -w * A / N


def test_sequence_normalisation_cancels_the_push_on_shared_tokens():
    """A short winner (2 tokens, A = +1) and a long loser (6 tokens, A = -1) that use one shared
    token per turn: per-token normalisation pushes the shared token down (net -4/8 per unit
    score), per-sequence normalisation leaves it alone."""
    assert token_weights([2, 6], "token") == [1 / 8, 1 / 8]
    assert token_weights([2, 0, 6], "sequence") == [1 / 4, 0.0, 1 / 12]
    for norm, net in (("token", -4 / 8), ("sequence", 0.0)):
        w = token_weights([2, 6], norm)
        weights = torch.tensor([w[0]] * 2 + [w[1]] * 6)
        lp = torch.zeros(8, requires_grad=True)
        adv = torch.tensor([1.0] * 2 + [-1.0] * 6)
        policy_loss(lp, lp.detach(), lp.detach(), adv, weights, tis_cap=5.0, clip_eps=0.2, kl_coef=0.0).loss.backward()
        assert float(-lp.grad.sum()) == pytest.approx(net, abs=1e-6)  # d(objective)/d(shared logit), summed
    with pytest.raises(ValueError, match="normalisation"):
        token_weights([1], "batch")


@pytest.mark.parametrize("strategy,execution", [
    ("summary", "kv_streams"), ("markovian_thinker", "kv_streams"), ("markovian_pick", "kv_streams"),
    ("sliding_window", "kv_streams"), ("sliding_window", "reprefill"),
])
def test_three_step_run_per_strategy(strategy, execution, tmp_path):
    """On real TextWorld games (generated once and cached), a tiny model, three trainer steps."""
    cfg = small(tmp_path, f"{strategy}-{execution}", "--compaction.strategy", strategy,
                "--compaction.execution", execution, "--compaction.summary_max_tokens", "4",
                "--compaction.pick_max_tokens", "4", "--environment.name", "textworld",
                "--environment.options", '{presets = ["short"], n_train = 4, n_eval = 0, max_steps = 6}',
                "--orchestrator.episode.max_new_tokens", "6")
    rows = asyncio.run(run(cfg, overlap=False))
    assert [r["step"] for r in rows] == [0, 1, 2]
    reprefilled = sum(r["tokens_reprefilled"] for r in rows)
    assert sum(r["compactions"] for r in rows) > 0
    assert reprefilled == 0 if execution == "kv_streams" else reprefilled > 0
    assert (tmp_path / f"{strategy}-{execution}" / "metrics.png").exists()
    # the episodes' time split: engine and game steps measured, TextWorld grades nothing apart
    assert all(r["episode_generate_s"] > 0 and r["episode_tool_s"] > 0 and r["episode_grade_s"] == 0 for r in rows)


def test_no_trained_sample_is_staler_than_async_level(tmp_path):
    cfg = small(tmp_path, "lag", "--orchestrator.async_level", "1", "--orchestrator.oversubscription", "3",
                "--run.steps", "5", "--environment.options.rooms", "4", "--orchestrator.episode.max_turns", "8")
    rows = asyncio.run(run(cfg, overlap=True))
    assert all(r["max_lag"] <= 1 for r in rows)
    assert max(int(k) for r in rows for k in r["lag_histogram"]) >= 1  # off-policy data was actually used
    assert "stale_rollouts_dropped" in rows[-1]
    print("lag histograms:", [r["lag_histogram"] for r in rows], "stale dropped:", rows[-1]["stale_rollouts_dropped"])


def test_a_time_budget_ends_the_run_and_held_out_evaluations_mark_its_gpu_seconds(tmp_path):
    """run.time_budget_s ends the run after the step that spends it; the held-out games are played at the start and
    at the end, each evaluation stamped with the GPU-seconds spent so far (its own time not counted); a resume from
    the checkpoint that spent the budget trains nothing more."""
    cfg = small(tmp_path, "budget", "--run.steps", "50", "--run.time_budget_s", "1e-6", "--evaluation.every", "10",
                "--environment.num_eval", "2")
    rows = asyncio.run(run(cfg, overlap=False))
    assert [r["step"] for r in rows] == [0] and rows[0]["gpu_s"] > 0

    def evals():
        return [json.loads(x) for x in (tmp_path / "budget" / "eval.jsonl").read_text().splitlines()]

    first = evals()
    assert [(e["step"], e["split"], e["episodes"]) for e in first] == [(0, "eval", 2), (1, "eval", 2)]
    assert first[0]["gpu_s"] == 0 and first[1]["gpu_s"] >= rows[0]["gpu_s"]
    rows = asyncio.run(run(cfg, resume=True, overlap=False))
    assert [r["step"] for r in rows] == [0] and evals() == first


def run_cli(out, steps, *extra):
    return [sys.executable, "-m", "harness.run", "configs/demo.toml", "--run.output_dir", str(out), "--run.steps",
            str(steps), "--run.checkpoint_every", "2", "--orchestrator.group_size", "2",
            "--orchestrator.groups_per_step", "2", "--orchestrator.episode.max_turns", "5",
            "--orchestrator.episode.env_in_thread", "false", "--no-overlap", *extra]


def run_checked(cmd, env):
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]


def digests(out):
    return [json.loads(line)["batch_digest"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_killed_run_resumes_with_the_same_trained_data(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT}
    run_checked(run_cli(tmp_path / "straight", 4), env)
    killed = tmp_path / "killed"
    proc = subprocess.Popen(run_cli(killed, 4), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    latest = killed / "checkpoints" / "latest"
    deadline = time.time() + 1200  # generous: CI machines may be loaded
    while not (latest.exists() and latest.read_text().strip() == "step_000002.pt"):
        assert proc.poll() is None and time.time() < deadline, "the run ended before its step-2 checkpoint"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    run_checked(run_cli(killed, 4, "--resume"), env)
    assert digests(killed) == digests(tmp_path / "straight") and len(digests(killed)) == 4


def test_the_trainers_warm_up_changes_nothing_it_would_train(tmp_path):
    """``Trainer.warm_up`` (run before a run's clock where scoring compiles: FlexAttention on CUDA) runs the policy's
    forward and backward and the reference's forward, and leaves the weights, the optimizer, the step count and the
    RNG as they were; a run whose scoring does not compile (SDPA here) skips it and says 0 s in its first row."""
    import copy

    from harness.distributed import TrainerRanks
    from harness.run import build_trainer

    cfg = small(tmp_path, "warm")
    trainer, _, _ = build_trainer(cfg, resume=False)
    before = copy.deepcopy(trainer.model.state_dict()), copy.deepcopy(trainer.optimizer.state_dict())
    rng = torch.random.get_rng_state()
    assert not trainer.compiles and TrainerRanks(trainer).warm_up() == 0.0  # SDPA on the CPU: nothing to compile
    assert trainer.warm_up() > 0  # called anyway: it runs
    assert all(torch.equal(v, trainer.model.state_dict()[k]) for k, v in before[0].items())
    assert trainer.optimizer.state_dict() == before[1] and trainer.step_count == 0
    assert all(p.grad is None for p in trainer.model.parameters())
    assert torch.equal(torch.random.get_rng_state(), rng)
    trainer.config = trainer.config.model_copy(update={"impl": "flex"})
    assert trainer.compiles


def test_paused_rollouts_call_no_engine_until_resumed(tmp_path):
    """``Orchestrator.pause`` (a checkpoint or an evaluation with ``run.drain_at_checkpoint = false``): the engine
    calls in flight return, then no episode touches the engine until ``resume``; the paused groups are the state's
    ``relaunch`` (a resumed run starts them again) and finish after the resume."""
    from transformers import AutoTokenizer

    from envs.registry import make_taskset
    from envs.rollout.chat import ChatRenderer
    from harness.inference import BuiltinInference
    from harness.orchestrator import Orchestrator
    from harness.run import build_trainer

    cfg = small(tmp_path, "paused", "--orchestrator.episode.max_turns", "12", "--environment.options.rooms", "10")

    async def scenario():
        _, path, _ = build_trainer(cfg, resume=False)
        inference = BuiltinInference(cfg.inference, path, torch.device("cpu"))
        streams = inference.engine.table.streams
        tasks = make_taskset(cfg.environment.name, cfg.environment.options)
        renderer = ChatRenderer(AutoTokenizer.from_pretrained(path), tasks.make_env().system_prompt)
        orch = Orchestrator(cfg.orchestrator, cfg.compaction, inference.client, tasks, renderer)
        orch.fill()
        while sum(st.ledger.num_computed > 0 for st in streams.values()) < 2:
            await asyncio.sleep(0.01)
        await orch.pause()
        paused = sorted(orch.running)
        state = orch.state_dict()

        def tokens():  # per stream: (appended, computed); a stream may close meanwhile (closing is not held)
            return {sid: (st.ledger.end, st.ledger.num_computed) for sid, st in streams.items()}

        held = [tokens()]
        ready = asyncio.ensure_future(orch.episode_client.ready())  # where an episode starts timing its turn
        for _ in range(5):
            await asyncio.sleep(0.1)
            held.append(tokens())
        assert not ready.done()
        orch.resume()
        await ready
        await orch.drain()
        return paused, state, held, [g.group_id for g in orch.completed], tokens()

    paused, state, held, finished, after = asyncio.run(scenario())
    assert paused and state["relaunch"] == paused
    for later in held[1:]:  # not one stream opened, not one token appended or computed while paused
        assert set(later) <= set(held[0]) and all(later[sid] == held[0][sid] for sid in later)
    assert set(paused) <= set(finished) and after != held[-1]  # and they went on after the resume


def test_a_run_paused_at_its_checkpoints_resumes_by_starting_the_paused_groups_again(tmp_path):
    """``run.drain_at_checkpoint = false``: each checkpoint and evaluation stops the rollouts in place (the eval rows
    say so, with the stop's seconds on the run's clock) instead of letting every group finish; the run's end abandons
    the paused groups, and a run resumed from its last checkpoint starts them again: no group is trained twice and
    none is lost (trained, waiting in the state, or dropped as stale)."""
    def cfg(steps):
        return small(tmp_path, "paused", "--run.steps", str(steps), "--run.checkpoint_every", "1",
                     "--run.drain_at_checkpoint", "false", "--orchestrator.oversubscription", "2",
                     "--evaluation.every", "1", "--environment.num_eval", "2")

    first = asyncio.run(run(cfg(2), overlap=False))
    state = checkpoint.load_latest(tmp_path / "paused" / "checkpoints")["orchestrator"]
    assert state["relaunch"]  # groups in flight at the run's end, not run to their end
    evals = [json.loads(x) for x in (tmp_path / "paused" / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 1, 2]
    assert all(not e["drained"] and e["stop_s"] >= 0 for e in evals[1:])
    rows = asyncio.run(run(cfg(4), resume=True, overlap=False))
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and rows[:2] == first
    assert [r.get("trainer_warm_up_s") for r in rows] == [0.0, None, 0.0, None]  # each process's first step
    trained = [gid for r in rows for gid in r["group_ids"]]
    assert len(trained) == len(set(trained))
    end = checkpoint.load_latest(tmp_path / "paused" / "checkpoints")["orchestrator"]
    waiting = [g["group_id"] for g in end["completed"]] + end["relaunch"]
    assert not set(waiting) & set(trained)
    assert len(trained) + len(waiting) + end["stale_groups"] == end["next_group"]
    assert set(state["relaunch"]) <= set(trained) | set(waiting)


def test_reward_rises_on_the_toy_corridor(tmp_path):
    cfg = load_config(os.path.join(ROOT, "configs/demo.toml"), [
        "--run.output_dir", str(tmp_path / "learn"), "--run.steps", "16", "--run.checkpoint_every", "100",
        "--orchestrator.episode.env_in_thread", "false",
        "--environment.options.doors", "left", "--orchestrator.groups_per_step", "2", "--trainer.lr", "2e-2",
        "--orchestrator.episode.max_new_tokens", "2"])
    rows = asyncio.run(run(cfg, overlap=False))
    first, last = [r["reward"] for r in rows[:4]], [r["reward"] for r in rows[-4:]]
    print("reward per step:", [round(r["reward"], 3) for r in rows])
    assert sum(last) / 4 > sum(first) / 4 + 0.15


@pytest.mark.parametrize("path", sorted(p for p in os.listdir(os.path.join(ROOT, "configs")) if p.endswith(".toml"))
                         + sorted(f"{d}/{f}" for d in ("textworld", "alfworld", "swe")
                                  for f in os.listdir(os.path.join(ROOT, "configs", d))))
def test_shipped_configs_validate(path):
    if path.startswith("demo_"):  # the demo's configs: the RL sections plus sft / evaluation
        from harness.demo import load_demo_config

        cfg = load_demo_config(os.path.join(ROOT, "configs", path))
        assert cfg.compaction.strategy == "sliding_window" and cfg.inference.kv_dtype == "kv4rl"
        assert cfg.environment.name == path.removeprefix("demo_").removesuffix(".toml")
        return
    if path == "swe/gpu_small.toml":  # bench.swe_e2e's: a harness config, the pipeline's GPU check
        cfg = load_config(os.path.join(ROOT, "configs", path))
        assert (cfg.compaction.strategy, cfg.compaction.execution, cfg.inference.kv_dtype) == (
            "sliding_window", "kv_streams", "kv4rl")
        return
    if path.endswith("gpu_small.toml"):  # bench.learning's: the RL sections plus sft / targets
        from bench.learning import LearningConfig

        cfg = load_config(os.path.join(ROOT, "configs", path), schema=LearningConfig)
        assert cfg.compaction.strategy == "sliding_window" and cfg.evaluation.every and cfg.run.time_budget_s
        return
    cfg = load_config(os.path.join(ROOT, "configs", path))
    assert cfg.compaction.strategy in path or path == "demo.toml"


def test_data_parallel_fsdp2_step_equals_one_process(tiny_model_path, tmp_path):
    """torchrun with 2 gloo processes shards the model and the batch; the update is the same."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.path.join(ROOT, 'tests')}"}
    script = os.path.join(ROOT, "tests", "dp_train_step.py")
    results = {}
    for procs in (1, 2):
        out = tmp_path / f"w{procs}.pt"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(procs), "--master-port",
               str(free_port()), script, str(tiny_model_path), str(out)]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
        results[procs] = torch.load(out)
    one, two = results[1], results[2]
    # the global gradient is the same (a missing world-size scaling would halve it) ...
    assert abs(one["metrics"]["grad_norm"] - two["metrics"]["grad_norm"]) < 1e-6 * one["metrics"]["grad_norm"]
    assert one["metrics"]["loss_tokens"] == two["metrics"]["loss_tokens"]
    # ... element by element ...
    assert one["grads"].keys() == two["grads"].keys() and one["grads"]
    for name, g in one["grads"].items():
        assert torch.allclose(g, two["grads"][name], rtol=1e-4, atol=1e-9), name
    # ... and so is the update. Adam's first step is lr * g / (|g| + eps): where |g| is near eps (1e-8) it divides
    # rounding-level gradient differences by a near-zero second moment, so those elements are held to the gradient
    # check above; everywhere else the update must agree to 1e-4 of the lr-sized step
    for name, w in one["state"].items():
        g = one["grads"][name]  # (tied weights under each of their names)
        well_conditioned = g.abs() > 1e-6
        diff = (w - two["state"][name]).abs()
        assert diff[well_conditioned].max() <= 1e-6, (name, float(diff[well_conditioned].max()))
        assert diff.max() <= 1e-3, (name, float(diff.max()))  # and nowhere more than a tenth of a step


def test_torchrun_two_ranks_trains_the_same_first_step_as_one_process(tmp_path):
    """The whole loop under torchrun (2 gloo ranks): rank 0 runs orchestrator + engine and
    announces each trainer call; rank 1 follows. Same data, same global gradient."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    run_checked(run_cli(tmp_path / "one", 2), env)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                str(free_port())]
    run_checked(torchrun + run_cli(tmp_path / "two", 2)[1:], env)
    one, two = ([json.loads(line) for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
                for d in ("one", "two"))
    assert len(two) == 2 and one[0]["batch_digest"] == two[0]["batch_digest"]
    assert one[0]["loss_tokens"] == two[0]["loss_tokens"]
    assert abs(one[0]["grad_norm"] - two[0]["grad_norm"]) < 1e-5 * one[0]["grad_norm"]


def test_reprefill_on_update_recomputes_carried_episodes(tmp_path):
    """A weight update lands while episodes are mid-flight: with ``reprefill_on_update``
    their kept KV is recomputed (counted); by default it is kept (0 recomputed)."""
    from transformers import AutoTokenizer

    from envs.registry import make_taskset
    from envs.rollout.chat import ChatRenderer
    from harness.distributed import TrainerRanks
    from harness.inference import BuiltinInference
    from harness.orchestrator import Orchestrator
    from harness.run import build_trainer, sync_weights

    cfg = small(tmp_path, "carried", "--orchestrator.episode.max_turns", "12", "--environment.options.rooms", "10")

    async def scenario():
        trainer, path, _ = build_trainer(cfg, resume=False)
        inference = BuiltinInference(cfg.inference, path, torch.device("cpu"))
        engine = inference.engine
        tasks = make_taskset(cfg.environment.name, cfg.environment.options)
        renderer = ChatRenderer(AutoTokenizer.from_pretrained(path), tasks.make_env().system_prompt)
        orch = Orchestrator(cfg.orchestrator, cfg.compaction, inference.client, tasks, renderer)
        orch.fill()
        while sum(st.ledger.num_computed > 0 for st in engine.table.streams.values()) < 2:
            await asyncio.sleep(0.01)
        counts = [await sync_weights(inference, TrainerRanks(trainer), orch, v, reprefill=v == 2) for v in (1, 2)]
        await orch.drain()
        return counts

    kept, recomputed = asyncio.run(scenario())
    assert kept == 0 and recomputed > 0

"""Offline SWE tasks end to end: built from real libraries, graded like SWE-bench, played through
the environment and the agent loop. One small build (two libraries) serves the whole module."""

import asyncio
import json
import time

import pytest
from transformers import AutoTokenizer

from envs.rollout.agent_loop import EpisodeConfig, run_episodes
from envs.rollout.chat import ChatRenderer
from envs.rollout.client import BuiltinClient
from envs.rollout.compaction import STRATEGIES, CompactionConfig
from envs.rollout.protocol import Environment, Task, TaskSet
from envs.swe import git
from envs.swe.builder import BuildConfig, build
from envs.swe.env import SweEnv, SweEnvConfig, SweTaskSet
from envs.swe.grading import apply_patch_command, evaluate, patched_files
from envs.swe.libraries import default_cache_dir
from envs.swe.sandbox import bwrap_path
from envs.swe.session import BashSession
from envs.swe.validate import breaking_patch
from envs.swe.workspace import TaskRepos
from kvstreams_sglang.engine import Engine

pytestmark = pytest.mark.skipif(bwrap_path() is None,
                                reason="bubblewrap not installed (apt-get install -y bubblewrap)")

PER_LIBRARY = {"parse": 3, "cachetools": 2}


def config(library: str, per_library: int) -> BuildConfig:
    return BuildConfig(libraries=(library,), per_library=per_library, seed=0, workers=2)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("swe_build")
    start = time.monotonic()
    instances, reports = [], []
    for library, n in PER_LIBRARY.items():
        got, (report,) = build(config(library, n), out, cache_dir=default_cache_dir())
        instances += got
        reports.append(report)
    seconds = time.monotonic() - start
    for r in reports:
        print(f"\n[swe build] {r.library}: kept {r.kept}/{r.tried} tried, baseline {r.baseline_tests} tests, "
              f"{r.seconds:.1f}s, rejected {dict(r.rejected)}")
    print(f"[swe build] {len(instances)} instances in {seconds:.1f}s")
    return out, instances, reports


@pytest.fixture(scope="module")
def repos(built):
    return TaskRepos(built[0] / "repos", scratch_dir=built[0] / "scratch")


@pytest.fixture(scope="module")
def taskset(built, repos):
    return SweTaskSet(built[1], repos, eval_fraction=0.5, config=SweEnvConfig(command_timeout_s=3))


def by_library(instances, name):
    return [i for i in instances if i.repo == f"pypi/{name}"]


def test_builder_keeps_instances_with_failing_and_passing_tests(built):
    _, instances, reports = built
    assert {r.library: r.kept for r in reports} == PER_LIBRARY
    assert len({i.instance_id for i in instances}) == len(instances)
    for inst in instances:
        assert inst.FAIL_TO_PASS and inst.PASS_TO_PASS
        assert not set(inst.FAIL_TO_PASS) & set(inst.PASS_TO_PASS)
        (fixed,) = patched_files(inst.patch)  # the gold patch touches one library file ...
        assert not fixed[0].startswith("tests/")
        assert {f for f, _ in patched_files(inst.test_patch)} <= set(inst.test_files)  # ... test_patch only tests


def test_gold_patch_resolves_and_the_base_fails_the_same_way_twice(built, repos):
    for inst in built[1]:
        gold = evaluate(inst, inst.patch, repos)
        assert gold.resolved and gold.f2p_fraction == 1.0 and gold.p2p_fraction == 1.0, inst.instance_id
        runs = [evaluate(inst, "", repos) for _ in range(2)]
        for empty in runs:
            assert not empty.resolved
            assert empty.f2p_failed == inst.FAIL_TO_PASS and empty.p2p_failed == []
        assert runs[0].f2p_failed == runs[1].f2p_failed


def test_a_patch_that_breaks_a_pass_to_pass_test_is_not_resolved(built, repos):
    for inst in (by_library(built[1], "parse")[0], by_library(built[1], "cachetools")[0]):
        victim = inst.PASS_TO_PASS[0]
        grade = evaluate(inst, inst.patch + breaking_patch(victim), repos)
        assert grade.applied and grade.f2p_fraction == 1.0
        assert not grade.resolved and grade.p2p_failed == [victim]


def test_a_patch_that_does_not_apply_is_not_resolved(built, repos):
    inst = built[1][0]
    lines = inst.patch.split("\n")
    removed = next(i for i, line in enumerate(lines) if line.startswith("-") and not line.startswith("---"))
    lines[removed] = "-a line that is not in the file"
    grade = evaluate(inst, "\n".join(lines), repos)
    assert not grade.applied and not grade.resolved and grade.f2p_fraction == 0.0


def test_failing_tests_are_hidden_until_grading(built, repos):
    hidden = 0
    for inst in by_library(built[1], "parse"):  # parse defines its tests in the test files themselves
        repo = repos.repo_path(inst)
        for test_id in inst.FAIL_TO_PASS:
            path, name = test_id.split("::")[0], test_id.split("::")[-1].split("[")[0]
            assert f"def {name}(" not in git.read_file(repo, inst.base_commit, path)
            assert f"def {name}(" in git.read_file(repo, "main", path)
            hidden += 1
        assert inst.test_patch.startswith("diff --git")
    assert hidden >= 3


def test_the_agent_checkout_holds_no_trace_of_the_fix(built, repos):
    for inst in built[1][:2]:
        path = inst.patch.split("\n", 1)[0].split(" b/")[-1]
        clean_blob = git.git(repos.repo_path(inst), "rev-parse", f"main:{path}").strip()
        workspace = repos.checkout(inst)
        try:
            r = BashSession(workspace.jail).run("git rev-list --all --count; git cat-file --batch-all-objects "
                                                "--batch-check='%(objectname)'", max_output_chars=None)
        finally:
            workspace.close()
        count, *objects = r.output.split()
        assert count == "1" and clean_blob not in objects and len(objects) > 10


def test_problem_statements_name_the_failure_not_the_fix(built):
    for inst in built[1]:
        assert inst.FAIL_TO_PASS[0] in inst.problem_statement
        fix_lines = [line[1:].strip() for line in inst.patch.split("\n") if line.startswith("+")
                     and not line.startswith("+++") and len(line.strip()) > 12]
        assert not any(line in inst.problem_statement for line in fix_lines), inst.instance_id


def test_the_build_is_reproducible_by_seed(built, tmp_path):
    first = by_library(built[1], "parse")[0]
    (again,) = build(config("parse", 1), tmp_path, cache_dir=default_cache_dir())[0]
    assert again == first


def test_env_and_taskset_implement_the_protocol(taskset):
    assert isinstance(taskset, TaskSet) and isinstance(taskset.make_env(), Environment)
    train, evals = taskset.tasks("train"), taskset.tasks("eval")
    assert len(train) + len(evals) == len(taskset.instances) and evals
    assert not {t.task_id for t in train} & {t.task_id for t in evals}


def play(env: SweEnv, task: Task, actions):
    env.reset(task)
    return [env.step(a) for a in actions]


def test_an_expert_episode_resolves_the_task(taskset):
    env = taskset.make_env()
    task = taskset.tasks("train")[0]
    env.reset(task)
    steps = []
    while (action := env.expert_action()) is not None:
        steps.append(env.step(action))
    env.close()
    assert [s.done for s in steps] == [False, True]
    assert steps[0].info["exit_code"] == 0
    assert steps[-1].reward == 1.0 and steps[-1].info["won"] and steps[-1].info["resolved"]


def test_submitting_nothing_earns_nothing(taskset):
    env = taskset.make_env()
    (result,) = play(env, taskset.tasks("train")[0], ["submit"])
    env.close()
    assert result.done and result.reward == 0.0 and not result.info["won"]
    assert result.info["f2p_fraction"] == 0.0 and result.info["p2p_fraction"] == 1.0
    assert result.info["grade_s"] > 0  # the hidden tests ran (the agent loop sums it as grading time)


@pytest.mark.parametrize("autosubmit", [True, False])
def test_an_episode_cut_by_its_cap_is_graded_on_its_diff(built, repos, autosubmit):
    taskset = SweTaskSet(by_library(built[1], "parse")[:1], repos, config=SweEnvConfig(submit_at_turn_cap=autosubmit))
    env = taskset.make_env()
    env.reset(taskset.tasks("all")[0])
    fix = env.step(env.expert_action())  # the gold patch applied, never submitted
    result = env.at_turn_cap()
    env.close()
    assert fix.info["exit_code"] == 0 and not fix.done
    if autosubmit:  # SWE-agent's autosubmission: the diff at the cap is graded
        assert result.done and result.reward == 1.0 and result.info["resolved"] and result.info["grade_s"] > 0
    else:
        assert result is None


def test_fixing_the_bug_but_breaking_another_test_earns_only_the_shaped_reward(built, repos):
    config = SweEnvConfig(reward_resolved=1.0, reward_unresolved=-0.25, shaped_weight=0.5)
    taskset = SweTaskSet(by_library(built[1], "parse")[:1], repos, config=config)
    env = taskset.make_env()
    env.reset(taskset.tasks("all")[0])
    inst = env.instance
    fix = env.step(env.expert_action())
    breaks = env.step("bash: " + apply_patch_command(breaking_patch(inst.PASS_TO_PASS[0])))
    result = env.step("submit")
    env.close()
    assert fix.info["exit_code"] == 0 and breaks.info["exit_code"] == 0
    assert not result.info["resolved"] and result.info["f2p_fraction"] == 1.0
    assert result.info["p2p_failed"] == [inst.PASS_TO_PASS[0]]
    assert result.reward == -0.25 + 0.5 * 1.0


def test_inside_an_episode_the_network_and_the_host_are_out_of_reach(taskset, tmp_path):
    env = taskset.make_env()
    net, write, runaway, alive = play(env, taskset.tasks("train")[0], [
        "bash: python -c \"import socket; socket.create_connection(('1.1.1.1', 443), timeout=5)\"",
        f"bash: touch {tmp_path}/escaped /etc/escaped",
        "bash: sleep 600",
        "bash: echo still here",
    ])
    env.close()
    assert "Network is unreachable" in net.observation and net.info["exit_code"] != 0
    assert write.info["exit_code"] != 0 and not (tmp_path / "escaped").exists()
    assert runaway.info["timed_out"] and "timed out after 3s" in runaway.observation and not runaway.done
    assert alive.observation.startswith("still here") and alive.info["exit_code"] == 0


def test_editor_edits_and_undoes_and_the_diff_is_what_gets_graded(taskset):
    env = taskset.make_env()
    task = taskset.tasks("train")[0]
    env.reset(task)
    path = env.instance.patch.split("\n", 1)[0].split(" b/")[-1]
    view = env.step(json_action("view", path=f"/testbed/{path}", view_range=[1, 3]))
    assert view.observation.startswith(f"Here's the result of running `cat -n` on /testbed/{path}")
    assert "     1\t" in view.observation and "     4\t" not in view.observation
    created = env.step(json_action("create", path="/testbed/notes.txt", file_text="hello\n"))
    assert "File created successfully" in created.observation
    edited = env.step(json_action("str_replace", path="notes.txt", old_str="hello", new_str="bye"))
    assert "has been edited" in edited.observation and "bye" in edited.observation
    missing = env.step(json_action("str_replace", path="notes.txt", old_str="hello", new_str="x"))
    assert "did not appear verbatim" in missing.observation
    assert "+bye" in env.current_patch()
    env.step(json_action("undo_edit", path="/testbed/notes.txt"))
    assert "+hello" in env.current_patch()
    env.step(json_action("undo_edit", path="/testbed/notes.txt"))
    assert env.current_patch() == ""
    bad = env.step("let me think about it")
    assert "No action found" in bad.observation and not bad.done
    env.close()


def json_action(command, **args):
    return "str_replace_editor: " + json.dumps({"command": command, **args})


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_random_tiny_model_plays_until_the_turn_cap(strategy, taskset, repos, tiny_model_path):
    engine = Engine(str(tiny_model_path), kv_slots=16384, max_streams=2)
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(tiny_model_path), SweEnv.system_prompt)
    compaction = CompactionConfig(strategy=strategy, window_turns=3, stride=1, summary_max_tokens=8, pick_max_tokens=8)
    config = EpisodeConfig(max_turns=4, max_new_tokens=8)
    start = time.monotonic()
    (episode,) = asyncio.run(run_episodes(BuiltinClient(engine), taskset.make_env, taskset.tasks("eval")[:1],
                                          renderer, compaction, config))
    print(f"\n[swe loop] {strategy}: {time.monotonic() - start:.1f}s {episode.stats.as_dict()}")
    assert episode.finish_reason == "max_turns" and episode.stats.turns == 4 and episode.reward == 0.0
    assert episode.stats.compactions >= (0 if strategy == "full_context" else 1)
    assert episode.stats.generate_s > 0 and episode.stats.env_s > episode.stats.grade_s > 0  # engine, tools
    # and the grading of the diff left at the turn cap (autosubmission): a random model resolves nothing
    assert len(episode.records) == 1
    assert not list((repos.scratch_dir).iterdir())  # the episode's checkout is gone



def test_swe_e2e_trains_and_reports_the_time_split(built, tmp_path):
    """bench.swe_e2e (issue 24's SWE run) at CPU size: one GRPO step of 2 episodes with Sliding Window +
    KV-streams + kv4rl, graded at the turn cap, and the report's time split."""
    from bench.swe_e2e import main as swe_e2e
    from envs.swe.instance import write_instances

    data = tmp_path / "data"
    data.mkdir()
    write_instances(data / "instances.jsonl", built[1])
    (data / "repos").symlink_to(built[0] / "repos")
    out = tmp_path / "run"
    rc = swe_e2e([
        "--config", "configs/swe/gpu_small.toml", "--data", str(data), "--out-dir", str(out),
        "--inference.device", "cpu", "--model.tiny.num_layers", "1", "--model.tiny.hidden_size", "32",
        "--model.tiny.intermediate_size", "64", "--model.tiny.num_heads", "2", "--inference.kv_slots", "16384",
        "--orchestrator.group_size", "2", "--orchestrator.groups_per_step", "1", "--orchestrator.episode.max_turns",
        "3", "--orchestrator.episode.max_new_tokens", "8", "--compaction.window_turns", "2", "--run.steps", "1",
        "--run.checkpoint_every", "1000"])
    assert rc == 0
    rep = json.loads((out / "swe_e2e.json").read_text())
    (step,) = rep["steps"]
    assert step["turns"] == 3 and step["compactions"] > 0 and step["tokens_reprefilled"] == 0
    assert step["episode_generate_s"] > 0 and step["episode_tool_s"] > 0 and step["episode_grade_s"] > 0
    assert abs(sum(rep["episode_time_share"].values()) - 1) < 1e-9 and rep["kv_dtype"] == "kv4rl"
    assert step["train_s"] > 0 and rep["mean_reward"] == 0.0  # graded at the cap; a random model fixes nothing

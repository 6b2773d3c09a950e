"""The SWE environment: one episode = one instance's fresh checkout, driven through the action
protocol, graded on ``submit`` with SWE-bench's rule.

``reset`` checks out ``base_commit`` into a jailed workspace and shows the problem statement;
``step`` runs one action; ``submit`` takes the tree's diff against ``base_commit`` (computed in
the jail) and grades it in a second fresh checkout, so nothing the agent did to the first
(tests edited, caches, a rewritten ``.git``) reaches the grade except the diff itself.
"""

from __future__ import annotations

import json
import posixpath
import random
import shlex
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from ..rollout.compaction import CompactionConfig
from ..rollout.protocol import StepResult, Task
from .actions import SYSTEM_PROMPT, Bash, Edit, Malformed, Submit, parse_action
from .grading import Grade, apply_patch_command, evaluate, heredoc
from .instance import SweInstance, load_instances
from .sandbox import WORKDIR, Limits
from .session import BashSession, truncate_middle
from .workspace import TaskRepos, Workspace, WorkspaceSource

_EDITOR_SOURCE = (Path(__file__).parent / "editor.py").read_text()


class SweEnvConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    command_timeout_s: float = Field(60.0, gt=0, description="wall-clock limit of one bash command")
    test_timeout_s: float = Field(600.0, gt=0, description="wall-clock limit of the graded test run")
    max_output_chars: int = Field(4000, ge=200, description="observation size; the middle is cut")
    reward_resolved: float = 1.0
    reward_unresolved: float = 0.0
    shaped_weight: float = Field(0.0, ge=0, description="unresolved reward = reward_unresolved + shaped_weight * "
                                                        "(fraction of FAIL_TO_PASS tests passing); 0 = binary")
    submit_at_turn_cap: bool = Field(True, description="an episode cut by its turn or token cap submits its current "
                                     "diff and is graded (SWE-agent's autosubmission); off: it earns nothing")


def swe_compaction(strategy: str = "sliding_window", **overrides) -> CompactionConfig:
    """Compaction defaults for SWE episodes (long: tens of tool calls with large outputs): compact
    every 30 turns, or as soon as the live context passes 64k tokens."""
    return CompactionConfig(**{"strategy": strategy, "window_turns": 30, "every_k_turns": 30, "budget": 65536,
                               **overrides})


def _first_observation(instance: SweInstance) -> str:
    return (f"<problem_statement>\n{instance.problem_statement.strip()}\n</problem_statement>\n\n"
            f"The repository ({instance.repo} {instance.version}) is checked out at {WORKDIR}. "
            "Make the change that resolves the problem statement, then submit.")


class SweEnv:
    system_prompt = SYSTEM_PROMPT

    def __init__(self, workspaces: WorkspaceSource, config: SweEnvConfig | None = None):
        self.workspaces, self.config = workspaces, config or SweEnvConfig()
        self.instance: SweInstance | None = None
        self.workspace: Workspace | None = None
        self.session: BashSession | None = None  # the agent's shell
        self.harness: BashSession | None = None  # ours (editor, diff): its cwd and variables are not the agent's
        self.history: dict[str, list[str | None]] = {}  # path -> previous texts, for undo_edit
        self.done = False

    def reset(self, task: Task) -> str:
        self.close()
        self.instance = SweInstance.model_validate(task.payload)
        self.workspace = self.workspaces.checkout(self.instance)
        self.session = BashSession(self.workspace.jail, timeout_s=self.config.command_timeout_s,
                                   max_output_chars=self.config.max_output_chars)
        self.harness = BashSession(self.workspace.jail, timeout_s=self.config.command_timeout_s)
        self.history, self.done = {}, False
        return _first_observation(self.instance)

    def step(self, action: str) -> StepResult:
        if self.session is None:
            raise RuntimeError("step() before reset()")
        if self.done:
            return StepResult("The episode is over (already submitted).", 0.0, True, {"tool": None})
        parsed = parse_action(action)
        if isinstance(parsed, Malformed):
            return StepResult(parsed.message, 0.0, False, {"tool": None, "malformed": True})
        if isinstance(parsed, Bash):
            r = self.session.run(parsed.command)
            return StepResult(r.render(self.config.command_timeout_s), 0.0, False,
                              {"tool": "bash", "exit_code": r.exit_code, "timed_out": r.timed_out})
        if isinstance(parsed, Edit):
            return StepResult(self._edit(parsed.args), 0.0, False, {"tool": "str_replace_editor"})
        assert isinstance(parsed, Submit)
        return self._submit()

    def _edit(self, args: dict) -> str:
        request = dict(args, root=WORKDIR)
        if args["command"] == "undo_edit":
            past = self.history.get(self._key(args["path"]))
            if past:
                request["previous"] = past[-1]
        command = heredoc(f"python3 -c {shlex.quote(_EDITOR_SOURCE)}", json.dumps(request))
        r = self.harness.run(command, max_output_chars=None)
        try:
            reply = json.loads(r.output.strip().rsplit("\n", 1)[-1])
        except (json.JSONDecodeError, IndexError):
            return truncate_middle(f"str_replace_editor failed:\n{r.output}", self.config.max_output_chars)[0]
        if reply.get("ok") and "path" in reply:
            key = self._key(reply["path"])
            if args["command"] == "undo_edit":
                self.history[key].pop()
            else:
                self.history.setdefault(key, []).append(reply.get("previous"))
        return truncate_middle(reply["observation"], self.config.max_output_chars)[0]

    @staticmethod
    def _key(path: str) -> str:
        return posixpath.normpath(posixpath.join(WORKDIR, path))

    def current_patch(self) -> str:
        """The tree's changes against ``base_commit``, new files included (computed in the jail)."""
        base = shlex.quote(self.instance.base_commit)
        r = self.harness.run(f"git add -A && git diff --cached --binary --no-color --no-ext-diff "
                             f"--src-prefix=a/ --dst-prefix=b/ {base}", max_output_chars=None)
        return r.output if r.exit_code == 0 else ""

    def at_turn_cap(self) -> StepResult | None:
        """The agent loop's hook for an episode cut by its cap: submit what is there (``submit_at_turn_cap``)."""
        if self.session is None or self.done or not self.config.submit_at_turn_cap:
            return None
        return self._submit()

    def _submit(self) -> StepResult:
        self.done = True
        patch = self.current_patch()
        t0 = time.perf_counter()
        grade: Grade = evaluate(self.instance, patch, self.workspaces, timeout_s=self.config.test_timeout_s)
        grade_s = time.perf_counter() - t0
        c = self.config
        reward = c.reward_resolved if grade.resolved else c.reward_unresolved + c.shaped_weight * grade.f2p_fraction
        info = {"tool": "submit", "won": grade.resolved, **grade.summary(), "patch": patch, "grade_s": grade_s}
        verdict = "resolved" if grade.resolved else "not resolved"
        return StepResult(f"Submitted. The tests ran: the issue is {verdict}.", reward, True, info)

    def expert_action(self) -> str | None:
        """Apply the gold patch, then submit."""
        if self.instance is None or self.done:
            return None
        if not self.current_patch().strip():
            return f"bash: cd {WORKDIR} && " + apply_patch_command(self.instance.patch)
        return "submit"

    def close(self) -> None:
        if self.workspace is not None:
            self.workspace.close()
        self.workspace = self.session = self.harness = None


class SweTaskSetOptions(BaseModel):
    """``environment.options`` of an SWE run: ``SweTaskSet``'s arguments."""

    model_config = ConfigDict(extra="forbid")

    instances: Path = Field(description="instances JSONL (make swe-data writes data/swe/instances.jsonl)")
    workspaces: Path = Field(description="task repositories (make swe-data writes data/swe/repos)")
    eval_fraction: float = Field(0.1, ge=0, le=1)
    seed: int = 0
    config: SweEnvConfig | None = None
    limits: Limits | None = None


class SweTaskSet:
    """Instances from a JSONL file (or a list), split into train/eval by a seeded shuffle."""

    def __init__(self, instances: list[SweInstance] | str | Path, workspaces: WorkspaceSource | str | Path, *,
                 eval_fraction: float = 0.1, seed: int = 0, config: SweEnvConfig | None = None,
                 limits: Limits | None = None):
        self.instances = load_instances(instances) if isinstance(instances, str | Path) else list(instances)
        if isinstance(workspaces, str | Path):
            workspaces = TaskRepos(workspaces, limits=limits)
        self.workspaces, self.config = workspaces, config
        order = sorted(self.instances, key=lambda i: i.instance_id)
        random.Random(seed).shuffle(order)
        n_eval = round(len(order) * eval_fraction)
        self.splits = {"eval": order[:n_eval], "train": order[n_eval:], "all": order}

    def tasks(self, split: str) -> list[Task]:
        if split not in self.splits:
            raise KeyError(f"unknown split {split!r}; have {sorted(self.splits)}")
        return [Task(i.instance_id, split, i.model_dump()) for i in self.splits[split]]

    def make_env(self, expert: bool = False) -> SweEnv:  # the expert (the gold patch) costs nothing
        return SweEnv(self.workspaces, self.config)

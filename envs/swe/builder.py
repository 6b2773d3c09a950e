"""The offline task builder (SWE-smith's recipe, without Docker or GitHub).

Per library: the pinned sdist's clean tree becomes the root commit of a local task repository;
its test suite runs twice and the tests that pass both times are the baseline. Then, for
mutation candidates in a seeded order (operators interleaved, at most ``max_per_function``
tasks per function): inject the bug into a copy of the tree, run the suite, and keep the
candidate when at least one baseline test now fails (FAIL_TO_PASS) and at least one other test
in the same files still passes (PASS_TO_PASS), both again on a rerun. A kept candidate becomes
an instance: its tree with the bug and without the FAIL_TO_PASS tests is a parentless commit
(``base_commit``), the reverse diff is the gold ``patch``, the removed tests are
``test_patch``. Finally the instance is graded like an agent's submission, in fresh checkouts:
the gold patch must resolve it and the empty patch must not.

Everything the mutated code runs runs in the sandbox: a mutant can delete files or spin.
"""

from __future__ import annotations

import hashlib
import random
import shutil
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from ..cpus import usable_cpus
from . import git
from .grading import evaluate
from .hidden_tests import remove_tests
from .instance import SweInstance
from .libraries import DEFAULT_LIBRARIES, LIBRARIES, Library, default_cache_dir, unpack_clean_tree
from .mutations import OPERATORS, Mutation, mutations
from .problem import problem_statement
from .pytest_log import ERROR, FAILED, PASSED, parse_statuses
from .sandbox import Limits, Sandbox
from .session import BashSession
from .workspace import TaskRepos, jailed_pythonpath, repo_dirname


class BuildConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    libraries: tuple[str, ...] = DEFAULT_LIBRARIES
    per_library: int = Field(20, ge=1, description="instances to keep per library")
    seed: int = 0
    max_per_function: int = Field(1, ge=1, description="instances per mutated function (diversity)")
    hide_tests: bool = Field(True, description="remove FAIL_TO_PASS tests from base_commit; test_patch restores them")
    validate_grading: bool = Field(True, description="grade gold (must resolve) and empty (must not) patches")
    workers: int = Field(usable_cpus(), ge=1)
    suite_timeout_s: float = Field(180.0, gt=0, description="one run of a library's test suite")
    slowdown: float = Field(8.0, gt=1, description="a mutant whose suite runs this much slower than the clean "
                                                   "one is dropped (it loops)")
    max_candidates: int | None = Field(None, ge=1, description="mutants tried per library (default: all)")


@dataclass
class LibraryReport:
    library: str
    kept: int = 0
    tried: int = 0
    rejected: Counter = field(default_factory=Counter)  # reason -> count
    baseline_tests: int = 0
    seconds: float = 0.0


@dataclass
class _Kept:
    instance: SweInstance
    function: str


def _test_id_ok(test_id: str) -> bool:
    return "::" in test_id and not any(c.isspace() for c in test_id)  # SWE-bench logs split on whitespace


class LibraryBuilder:
    """Builds the instances of one library into ``repos_dir``."""

    def __init__(self, lib: Library, config: BuildConfig, repos_dir: Path, cache_dir: Path, limits: Limits):
        self.lib, self.config, self.limits = lib, config, limits
        self.clean = unpack_clean_tree(lib, cache_dir)
        self.repo = repos_dir / repo_dirname(lib.repo, lib.version)
        self.workspaces = TaskRepos(repos_dir, limits=limits)
        self.report = LibraryReport(lib.name)
        self.stop = threading.Event()  # set once enough instances are kept: in-flight candidates give up
        self.mutant_timeout_s = config.suite_timeout_s

    # -- test runs -----------------------------------------------------------------------------

    def _run_suite(self, tree: Path, paths: list[str]) -> tuple[dict[str, str], str, bool]:
        """(statuses, log, timed out) of the tests under ``paths`` in ``tree``."""
        env = {"PYTHONPATH": jailed_pythonpath(self.lib.python_path)}
        session = BashSession(Sandbox(tree, limits=self.limits, env=env))
        r = session.run(f"{self.lib.test_cmd} {' '.join(paths)}", timeout=self.mutant_timeout_s,
                        max_output_chars=None)
        return parse_statuses(r.output), r.output, r.timed_out

    def _scratch_tree(self) -> Path:
        tmp = Path(tempfile.mkdtemp(prefix=f"swe-build-{self.lib.name}."))
        shutil.copytree(self.clean, tmp / "tree", symlinks=True)
        return tmp / "tree"

    def baseline(self) -> dict[str, str]:
        """Tests passing in two runs of the clean suite: test id -> its file."""
        tree = self._scratch_tree()
        start = time.monotonic()
        try:
            runs = [self._run_suite(tree, list(self.lib.tests)) for _ in range(2)]
        finally:
            shutil.rmtree(tree.parent, ignore_errors=True)
        # Mutants that loop forever are common (a flipped loop condition); waiting the full suite
        # timeout on each would stall the build.
        clean_s = (time.monotonic() - start) / 2
        self.mutant_timeout_s = min(self.config.suite_timeout_s, max(15.0, self.config.slowdown * clean_s))
        (s1, log, _), (s2, _, _) = runs
        stable = {t: t.split("::", 1)[0] for t, s in s1.items() if s == PASSED and s2.get(t) == PASSED
                  and _test_id_ok(t)}
        if not stable:
            raise RuntimeError(f"{self.lib.name}: no test passes on the clean tree; the log ends:\n{log[-3000:]}")
        self.report.baseline_tests = len(stable)
        return stable

    # -- candidates ----------------------------------------------------------------------------

    def candidates(self) -> list[Mutation]:
        """Every mutant of the library's sources, operators interleaved in a seeded order."""
        by_op: dict[str, list[Mutation]] = {op: [] for op in OPERATORS}
        files = []
        for src in self.lib.sources:
            p = self.clean / src
            files += [p] if p.is_file() else sorted(p.rglob("*.py"))
        excluded = tuple(self.lib.exclude) + tuple(self.lib.tests)
        for path in files:
            rel = path.relative_to(self.clean).as_posix()
            if rel.startswith(excluded) or "/tests/" in f"/{rel}":
                continue
            for m in mutations(rel, path.read_text()):
                by_op[m.operator].append(m)
        rng = random.Random(f"{self.config.seed}:{self.lib.name}")
        for ms in by_op.values():
            rng.shuffle(ms)
        order = [m for group in zip(*_padded(list(by_op.values())), strict=True) for m in group if m is not None]
        return order[: self.config.max_candidates] if self.config.max_candidates else order

    def try_candidate(self, m: Mutation, baseline: dict[str, str], clean_commit: str) -> _Kept | str:
        """The instance ``m`` makes, or why it makes none."""
        source = m.apply((self.clean / m.path).read_text())
        if source is None:
            return "mutant does not parse"
        tree = self._scratch_tree()
        try:
            (tree / m.path).write_text(source)
            s1, log, timed_out = self._run_suite(tree, list(self.lib.tests))
            if timed_out:
                return "suite timed out"
            f2p = sorted(t for t in baseline if s1.get(t) in (FAILED, ERROR))
            if not f2p:
                return "no test fails"
            files = sorted({baseline[t] for t in f2p})
            p2p = sorted(t for t in baseline if baseline[t] in files and s1.get(t) == PASSED)
            if not p2p:
                return "no test passes in the failing files"
            if self.stop.is_set():
                return "build already complete"
            s2, _, timed_out = self._run_suite(tree, files)
            if timed_out:
                return "suite timed out"
        finally:
            shutil.rmtree(tree.parent, ignore_errors=True)
        f2p = [t for t in f2p if s2.get(t) in (FAILED, ERROR)]
        p2p = [t for t in p2p if s2.get(t) == PASSED]
        if not f2p or not p2p:
            return "unstable on rerun"
        return self._instance(m, source, f2p, p2p, log, clean_commit)

    def _instance(self, m: Mutation, source: str, f2p: list[str], p2p: list[str], log: str,
                  clean_commit: str) -> _Kept | str:
        lib = self.lib
        test_texts = {f: (self.clean / f).read_text() for f in sorted({t.split("::", 1)[0] for t in f2p + p2p})}
        hidden: dict[str, str] = {}
        if self.config.hide_tests:
            for f, text in test_texts.items():
                new, removed = remove_tests(text, [t for t in f2p if t.startswith(f + "::")])
                if removed:
                    hidden[f] = new
        digest = hashlib.sha256(f"{m.path}\0{source}".encode()).hexdigest()[:8]
        instance_id = f"{lib.name}-{lib.version}.{m.operator}.{digest}"
        fixed_tree = git.tree_with(self.repo, clean_commit, hidden)
        base_tree = git.tree_with(self.repo, clean_commit, {**hidden, m.path: source})
        base_commit = git.orphan_commit(self.repo, base_tree, f"{lib.name} {lib.version}")
        statement = problem_statement(repo=lib.repo, version=lib.version, failing=f2p, log=log,
                                      sources=test_texts, test_prefixes=tuple(lib.tests))
        instance = SweInstance(
            instance_id=instance_id, repo=lib.repo, base_commit=base_commit, version=lib.version,
            patch=git.diff(self.repo, base_tree, fixed_tree), test_patch=git.diff(self.repo, fixed_tree, clean_commit),
            problem_statement=statement, FAIL_TO_PASS=f2p, PASS_TO_PASS=p2p, test_cmd=lib.test_cmd,
            python_path=lib.python_path)
        if self.config.validate_grading and not self.stop.is_set():
            if not (gold := evaluate(instance, instance.patch, self.workspaces,
                                     timeout_s=self.config.suite_timeout_s)).resolved:
                return f"gold patch does not resolve ({len(gold.f2p_failed)} F2P, {len(gold.p2p_failed)} P2P fail)"
            if evaluate(instance, "", self.workspaces, timeout_s=self.config.suite_timeout_s).resolved:
                return "empty patch resolves"
        return _Kept(instance, m.function)

    # -- the loop ------------------------------------------------------------------------------

    def build(self, on_kept: Callable[[SweInstance], None] | None = None,
              on_tried: Callable[[], None] | None = None) -> list[SweInstance]:
        start = time.monotonic()
        shutil.rmtree(self.repo, ignore_errors=True)
        clean_commit = git.init_repo(self.repo, self.clean)
        baseline = self.baseline()
        cap, kept, per_function = self.config.per_library, [], Counter()
        todo: Iterator[Mutation] = iter(self.candidates())
        window: deque[tuple[Mutation, Future]] = deque()
        with ThreadPoolExecutor(self.config.workers) as pool:
            def fill():
                while len(window) < 4 * self.config.workers:  # results are consumed in order
                    m = next(todo, None)
                    if m is None:
                        return
                    if per_function[m.function] < self.config.max_per_function:
                        window.append((m, pool.submit(self.try_candidate, m, baseline, clean_commit)))

            fill()
            while window and len(kept) < cap:
                m, fut = window.popleft()
                result = fut.result()
                self.report.tried += 1
                if on_tried:
                    on_tried()
                if isinstance(result, str):
                    self.report.rejected[result] += 1
                elif per_function[result.function] >= self.config.max_per_function:
                    self.report.rejected["function already has a task"] += 1
                elif any(k.instance_id == result.instance.instance_id for k in kept):
                    self.report.rejected["same mutant as a kept one"] += 1
                else:
                    per_function[result.function] += 1
                    git.git(self.repo, "update-ref", f"refs/tags/{result.instance.instance_id}",
                            result.instance.base_commit)
                    kept.append(result.instance)
                    if on_kept:
                        on_kept(result.instance)
                fill()
            self.stop.set()
            for _, fut in window:
                fut.cancel()
        self.report.kept, self.report.seconds = len(kept), time.monotonic() - start
        return kept


def _padded(groups: list[list]) -> list[list]:
    n = max((len(g) for g in groups), default=0)
    return [g + [None] * (n - len(g)) for g in groups]


def build(config: BuildConfig, out_dir: str | Path, *, cache_dir: str | Path | None = None,
          limits: Limits | None = None, on_kept=None, on_tried=None) -> tuple[list[SweInstance], list[LibraryReport]]:
    """Build every configured library into ``out_dir/repos``; returns the instances and a report
    per library (the caller writes the JSONL)."""
    # absolute: git runs with --git-dir from the library's source tree, where a relative path means nothing
    out_dir, cache = Path(out_dir).resolve(), Path(cache_dir) if cache_dir else default_cache_dir()
    limits = limits or Limits(timeout_s=config.suite_timeout_s)
    unknown = [n for n in config.libraries if n not in LIBRARIES]
    if unknown:
        raise ValueError(f"unknown libraries {unknown}; known: {sorted(LIBRARIES)}")
    instances, reports = [], []
    for name in config.libraries:
        builder = LibraryBuilder(LIBRARIES[name], config, out_dir / "repos", cache, limits)
        instances += builder.build(on_kept, on_tried)
        reports.append(builder.report)
    return instances, reports

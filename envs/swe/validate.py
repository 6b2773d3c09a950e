"""Command line: check that built instances grade the way SWE-bench would.

    python -m envs.swe.validate --out data/swe --sample 30

For a seeded sample: the gold patch must resolve every instance, the empty patch none, and the
gold patch plus a change that breaks one PASS_TO_PASS test must not resolve it either. The
breaking change is a root ``conftest.py`` failing that one test, so suites run with
``--noconftest`` are left out of that third check.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from tqdm import tqdm

from .grading import evaluate
from .instance import SweInstance, load_instances
from .workspace import TaskRepos


def breaking_patch(test_id: str) -> str:
    """A git diff adding a root ``conftest.py`` that makes exactly ``test_id`` fail."""
    body = ["import pytest", "", "", "@pytest.hookimpl(tryfirst=True)", "def pytest_runtest_call(item):",
            f"    if item.nodeid == {test_id!r}:", "        raise AssertionError('broken on purpose')"]
    return ("diff --git a/conftest.py b/conftest.py\nnew file mode 100644\n--- /dev/null\n+++ b/conftest.py\n"
            f"@@ -0,0 +1,{len(body)} @@\n" + "".join(f"+{line}\n" for line in body))


def check(instance: SweInstance, repos: TaskRepos) -> dict[str, bool | None]:
    """Which of the three expectations hold (None: not checkable for this suite)."""
    gold = evaluate(instance, instance.patch, repos).resolved
    empty = not evaluate(instance, "", repos).resolved
    if "--noconftest" in instance.test_cmd:
        broken = None
    else:
        victim = instance.PASS_TO_PASS[0]
        grade = evaluate(instance, instance.patch + breaking_patch(victim), repos)
        broken = not grade.resolved and grade.p2p_failed == [victim]
    return {"gold resolves": gold, "empty does not": empty, "broken P2P does not": broken}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m envs.swe.validate", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="a build directory (instances.jsonl, repos/)")
    p.add_argument("--sample", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    instances = load_instances(args.out / "instances.jsonl")
    sample = random.Random(args.seed).sample(instances, min(args.sample, len(instances)))
    repos = TaskRepos(args.out / "repos")
    start, failures, totals = time.monotonic(), [], {}
    for inst in tqdm(sample, unit="task", desc="grading"):
        for name, ok in check(inst, repos).items():
            if ok is not None:
                passed, n = totals.get(name, (0, 0))
                totals[name] = (passed + ok, n + 1)
                if not ok:
                    failures.append(f"{inst.instance_id}: {name} FAILED")
    for name, (passed, n) in totals.items():
        print(f"{name}: {passed}/{n}")
    print("\n".join(failures) or "all expectations hold", f"({time.monotonic() - start:.0f}s)")
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()

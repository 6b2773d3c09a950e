"""Grading a patch the way SWE-bench does.

In a fresh checkout of ``base_commit``: apply the patch (``git apply``, then ``patch --fuzz``
as SWE-bench's harness falls back to), reset the test files ``test_patch`` touches to the base
commit and apply ``test_patch`` (the agent cannot have edited the graded tests), run the test
files, parse the ``-rA`` log. A test counts as passed when its status is PASSED or XFAIL, as
failed when it is FAILED or ERROR or absent from the log (``swebench.harness.grading``). The
instance is resolved iff every FAIL_TO_PASS and every PASS_TO_PASS test passed.
"""

from __future__ import annotations

import re
import secrets
import shlex
from dataclasses import dataclass, field

from .instance import SweInstance
from .pytest_log import ERROR, FAILED, PASSED, XFAIL, parse_statuses
from .session import BashSession
from .workspace import WorkspaceSource


def heredoc(command: str, text: str) -> str:
    """``command`` with ``text`` on its stdin, as one bash command line."""
    tag = f"KVSTREAMS_EOF_{secrets.token_hex(8)}"
    body = text if text.endswith("\n") else text + "\n"
    return f"{command} <<'{tag}'\n{body}{tag}"


def apply_patch_command(patch: str) -> str:
    """Apply ``patch`` (a git diff) to the current directory; SWE-bench's two attempts."""
    path = "/tmp/kvstreams.patch"  # the jail's private /tmp
    return (heredoc(f"cat > {path}", patch)
            + f"\ngit apply --verbose --binary {path} || patch --batch --fuzz=5 -p1 -i {path}")


def patched_files(patch: str) -> list[tuple[str, bool]]:
    """(path, created by the patch) for every file a git diff touches."""
    files, current = [], None
    for line in patch.split("\n"):
        if m := re.match(r"diff --git a/(\S+) b/(\S+)", line):
            current = m.group(2)
            files.append((current, False))
        elif line.startswith("new file mode") and current is not None:
            files[-1] = (current, True)
    return files


@dataclass
class Grade:
    resolved: bool
    applied: bool  # the patch applied; False grades as unresolved
    f2p_passed: list[str] = field(default_factory=list)
    f2p_failed: list[str] = field(default_factory=list)
    p2p_passed: list[str] = field(default_factory=list)
    p2p_failed: list[str] = field(default_factory=list)
    log: str = ""

    @staticmethod
    def _rate(passed: list, failed: list) -> float:
        total = len(passed) + len(failed)
        return 1.0 if total == 0 else len(passed) / total  # SWE-bench's convention for an empty list

    @property
    def f2p_fraction(self) -> float:
        return self._rate(self.f2p_passed, self.f2p_failed) if self.applied else 0.0

    @property
    def p2p_fraction(self) -> float:
        return self._rate(self.p2p_passed, self.p2p_failed) if self.applied else 0.0

    def summary(self) -> dict:
        return {"resolved": self.resolved, "patch_applied": self.applied, "f2p_fraction": self.f2p_fraction,
                "p2p_fraction": self.p2p_fraction, "f2p_failed": self.f2p_failed, "p2p_failed": self.p2p_failed}


def grade_statuses(instance: SweInstance, statuses: dict[str, str], log: str = "") -> Grade:
    grade = Grade(resolved=False, applied=True, log=log)
    for tests, passed, failed in ((instance.FAIL_TO_PASS, grade.f2p_passed, grade.f2p_failed),
                                  (instance.PASS_TO_PASS, grade.p2p_passed, grade.p2p_failed)):
        for test in tests:
            status = statuses.get(test)
            if status in (PASSED, XFAIL):
                passed.append(test)
            elif status is None or status in (FAILED, ERROR):
                failed.append(test)
    grade.resolved = grade.f2p_fraction == 1.0 and grade.p2p_fraction == 1.0
    return grade


def run_tests(instance: SweInstance, session: BashSession, *, timeout_s: float) -> str:
    """Reset the graded test files, apply ``test_patch``, run them; the full log."""
    if instance.test_patch.strip():
        files = patched_files(instance.test_patch)
        old = [shlex.quote(p) for p, created in files if not created]
        new = [shlex.quote(p) for p, created in files if created]
        reset = " && ".join(filter(None, [
            f"git checkout --quiet {shlex.quote(instance.base_commit)} -- {' '.join(old)}" if old else "",
            f"rm -rf -- {' '.join(new)}" if new else ""]))
        r = session.run(f"{reset} && " + apply_patch_command(instance.test_patch), max_output_chars=None)
        if r.exit_code != 0:
            raise RuntimeError(f"{instance.instance_id}: test_patch does not apply:\n{r.output[-2000:]}")
    files = " ".join(shlex.quote(f) for f in instance.test_files)
    return session.run(f"{instance.test_cmd} {files}", timeout=timeout_s, max_output_chars=None).output


def evaluate(instance: SweInstance, patch: str, workspaces: WorkspaceSource, *, timeout_s: float = 600.0) -> Grade:
    """Grade ``patch`` (a git diff against ``base_commit``) in a fresh checkout."""
    workspace = workspaces.checkout(instance)
    try:
        session = BashSession(workspace.jail, timeout_s=120.0)
        if patch.strip():
            r = session.run(apply_patch_command(patch), max_output_chars=None)
            if r.exit_code != 0:
                return Grade(resolved=False, applied=False, log=r.output)
        log = run_tests(instance, session, timeout_s=timeout_s)
        return grade_statuses(instance, parse_statuses(log), log)
    finally:
        workspace.close()

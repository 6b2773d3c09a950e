"""Host-side git on the task repositories (trusted trees only; the agent's tree is only ever
touched from inside the sandbox, since its ``.git/config`` could name programs git would run).

A library's task repository holds the clean tree as its root commit (branch ``main``) and, per
instance, a parentless commit with the bug injected and the hidden tests removed (tag
``<instance_id>``, the instance's ``base_commit``). Parentless, so that an agent's ``git log``
or ``git diff HEAD~1`` cannot show the fix; and an episode's checkout fetches that one commit
alone, so the object store holds nothing but the buggy tree either. Dates and identities are
fixed, so a rebuild with the same seed gives the same commit ids.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

_IDENTITY = {
    "GIT_AUTHOR_NAME": "kvstreams", "GIT_AUTHOR_EMAIL": "swe@kvstreams.invalid",
    "GIT_COMMITTER_NAME": "kvstreams", "GIT_COMMITTER_EMAIL": "swe@kvstreams.invalid",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000", "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000",
    "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_TERMINAL_PROMPT": "0",
}
# Caches the agent's tools leave behind are not part of its change.
EXCLUDES = "__pycache__/\n*.py[cod]\n.pytest_cache/\n*.egg-info/\n"


def git(repo: str | Path, *args: str, input: str | None = None, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(["git", "-C", str(repo), *args], input=input, capture_output=True, text=True,
                          env={**os.environ, **_IDENTITY, **(env or {})})
    if proc.returncode != 0:
        raise RuntimeError(f"git {' '.join(args[:3])} failed in {repo}: {proc.stderr.strip()}")
    return proc.stdout


def init_repo(repo: Path, tree: Path) -> str:
    """A repository whose root commit (``main``) is the contents of ``tree``; returns its id."""
    repo.mkdir(parents=True)
    git(repo, "init", "--quiet", "--initial-branch", "main")
    git(repo, "config", "uploadpack.allowAnySHA1InWant", "true")  # checkouts fetch single commits by id
    (repo / ".git" / "info" / "exclude").write_text(EXCLUDES)
    git(tree, f"--git-dir={repo / '.git'}", "--work-tree=.", "add", "--all", "--force", ".")
    commit = git(repo, "commit-tree", git(repo, "write-tree").strip(), "-m", "clean tree").strip()
    git(repo, "update-ref", "refs/heads/main", commit)
    return commit


def tree_with(repo: Path, base: str, files: dict[str, str]) -> str:
    """The id of ``base``'s tree with ``files`` (path -> new text) replaced."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        git(repo, "read-tree", base, env=env)
        for path, text in files.items():
            blob = git(repo, "hash-object", "-w", "--stdin", "--path", path, input=text).strip()
            git(repo, "update-index", "--cacheinfo", f"100644,{blob},{path}", env=env)
        return git(repo, "write-tree", env=env).strip()


def orphan_commit(repo: Path, tree: str, message: str) -> str:
    return git(repo, "commit-tree", tree, "-m", message).strip()


def diff(repo: Path, a: str, b: str) -> str:
    return git(repo, "diff", "--binary", "--no-color", "--no-ext-diff", a, b)


def read_file(repo: Path, rev: str, path: str) -> str:
    return git(repo, "show", f"{rev}:{path}")


def checkout(repo: Path, commit: str, dest: Path) -> None:
    """A standalone repository at ``dest`` holding ``commit`` only, checked out on ``main``."""
    dest.mkdir(parents=True)
    git(dest, "init", "--quiet", "--initial-branch", "main")
    git(dest, "fetch", "--quiet", "--depth", "1", "--no-tags", str(repo), commit)
    git(dest, "reset", "--quiet", "--hard", commit)
    (dest / ".git" / "FETCH_HEAD").unlink(missing_ok=True)  # names the task repository's path
    (dest / ".git" / "info" / "exclude").write_text(EXCLUDES)

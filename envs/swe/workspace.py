"""Where an instance's tree lives while commands run in it: a fresh checkout of its base commit,
jailed. Episodes and grading both open one per use and close it after.

``TaskRepos`` serves the offline builder's local repositories (checkout on the host, commands
in bubblewrap); ``envs.swe.docker.SwebenchImages`` serves SWE-bench's Docker images. Both give
a ``Workspace`` whose ``jail`` a ``BashSession`` drives.
"""

from __future__ import annotations

import posixpath
import shutil
import tempfile
from pathlib import Path
from typing import Protocol

from . import git
from .instance import SweInstance
from .sandbox import WORKDIR, Limits, Sandbox
from .session import Jail


class Workspace(Protocol):
    jail: Jail

    def close(self) -> None: ...


class WorkspaceSource(Protocol):
    def checkout(self, instance: SweInstance) -> Workspace: ...


def jailed_pythonpath(python_path: str) -> str:
    return posixpath.normpath(f"{WORKDIR}/{python_path}")


def repo_dirname(repo: str, version: str) -> str:
    return f"{repo.replace('/', '__')}-{version}"


class LocalWorkspace:
    def __init__(self, path: Path, jail: Sandbox):
        self.path, self.jail = path, jail

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


class TaskRepos:
    """Checkouts of the task repositories under ``repos_dir`` (one per ``repo``/``version``)."""

    def __init__(self, repos_dir: str | Path, *, scratch_dir: str | Path | None = None, limits: Limits | None = None):
        self.repos_dir = Path(repos_dir)
        self.scratch_dir = Path(scratch_dir) if scratch_dir else None
        self.limits = limits or Limits()

    def repo_path(self, instance: SweInstance) -> Path:
        path = self.repos_dir / repo_dirname(instance.repo, instance.version)
        if not (path / ".git").is_dir():
            raise FileNotFoundError(f"no task repository for {instance.repo} {instance.version} at {path} "
                                    f"(build it with `python -m envs.swe.build`)")
        return path

    def checkout(self, instance: SweInstance) -> LocalWorkspace:
        repo = self.repo_path(instance)
        if self.scratch_dir:
            self.scratch_dir.mkdir(parents=True, exist_ok=True)
        path = Path(tempfile.mkdtemp(prefix=f"{instance.instance_id[:40]}.", dir=self.scratch_dir)) / "testbed"
        try:
            git.checkout(repo, instance.base_commit, path)
            env = {"PYTHONPATH": jailed_pythonpath(instance.python_path)}
            return LocalWorkspace(path.parent, Sandbox(path, limits=self.limits, env=env))
        except BaseException:
            shutil.rmtree(path.parent, ignore_errors=True)
            raise

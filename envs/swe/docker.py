"""Optional runtime for real SWE-bench instances: their published Docker images as the jail.

Each image holds the repository at ``/testbed`` at ``base_commit`` and a conda env ``testbed``
with its dependencies; a container started from it (no network, memory and PID limits) serves
one episode or one grading run, commands go in by ``docker exec``. Grading parses pytest
``-rA`` logs only, so it suits the pytest-based repositories; give each instance the
``test_cmd`` SWE-bench's harness uses for its repo and version. Needs a Docker daemon and the
images pulled; nothing here runs without them.
"""

from __future__ import annotations

import math
import shutil
import subprocess
from collections.abc import Callable
from typing import BinaryIO

from .instance import SweInstance
from .sandbox import WORKDIR, Limits

ACTIVATE = "source /opt/miniconda3/bin/activate testbed >/dev/null 2>&1 || true"


def docker_available(docker: str = "docker") -> bool:
    if shutil.which(docker) is None:
        return False
    return subprocess.run([docker, "info"], capture_output=True).returncode == 0


def swebench_image(instance: SweInstance) -> str:
    """The image SWE-bench publishes for an instance (``swebench/sweb.eval.x86_64.<id>``)."""
    return f"swebench/sweb.eval.x86_64.{instance.instance_id.lower().replace('__', '_1776_')}:latest"


class DockerContainer:
    """A running container used as a ``Jail``; ``close`` removes it."""

    def __init__(self, image: str, *, limits: Limits | None = None, docker: str = "docker",
                 prelude: str = ACTIVATE):
        self.docker, self.limits, self.prelude = docker, limits or Limits(), prelude
        proc = subprocess.run([docker, "run", "--detach", "--rm", "--network", "none",
                               "--memory", f"{self.limits.memory_mb}m", "--pids-limit", "1024",
                               "--workdir", WORKDIR, image, "sleep", "infinity"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"docker could not start {image}: {proc.stderr.strip()}")
        self.container = proc.stdout.strip()

    def exec(self, argv: list[str], *, stdin: bytes = b"", output: BinaryIO, timeout: float | None = None
             ) -> tuple[int | None, bool]:
        timeout = timeout or self.limits.timeout_s
        # `timeout` inside the container kills the command's whole process group; killing the
        # docker client here would leave it running.
        cmd = [self.docker, "exec", "-i", "--workdir", WORKDIR, self.container,
               "timeout", "--signal=KILL", str(math.ceil(timeout)),
               "bash", "-c", f'{self.prelude}; ulimit -f {self.limits.file_size_mb * 1024}; exec "$@"', "jail", *argv]
        proc = subprocess.run(cmd, input=stdin, stdout=output, stderr=subprocess.STDOUT)
        if proc.returncode == 137:  # SIGKILL from `timeout`
            return None, True
        return proc.returncode, False

    def close(self) -> None:
        subprocess.run([self.docker, "rm", "--force", self.container], capture_output=True)


class DockerWorkspace:
    def __init__(self, container: DockerContainer):
        self.jail = container

    def close(self) -> None:
        self.jail.close()


class SwebenchImages:
    """``WorkspaceSource`` over Docker images: one fresh container per checkout."""

    def __init__(self, image_for: Callable[[SweInstance], str] = swebench_image, *, limits: Limits | None = None,
                 docker: str = "docker"):
        self.image_for, self.limits, self.docker = image_for, limits, docker

    def checkout(self, instance: SweInstance) -> DockerWorkspace:
        return DockerWorkspace(DockerContainer(self.image_for(instance), limits=self.limits, docker=self.docker))

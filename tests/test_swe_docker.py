"""The optional Docker runtime (for SWE-bench's images) behaves like the bubblewrap jail: commands
run in /testbed with no network and are killed at their timeout. Runs only where a Docker daemon
and the image are available (set KVSTREAMS_SWE_DOCKER_IMAGE to any image with bash)."""

import os
import subprocess

import pytest

from envs.swe.docker import DockerContainer, docker_available
from envs.swe.sandbox import Limits
from envs.swe.session import BashSession

IMAGE = os.environ.get("KVSTREAMS_SWE_DOCKER_IMAGE", "python:3.11-slim")


def image_present() -> bool:
    return docker_available() and subprocess.run(["docker", "image", "inspect", IMAGE],
                                                 capture_output=True).returncode == 0


pytestmark = pytest.mark.skipif(not image_present(), reason=f"needs a Docker daemon and the image {IMAGE}")


def test_docker_container_is_a_jail():
    container = DockerContainer(IMAGE, limits=Limits(timeout_s=5))
    try:
        s = BashSession(container)
        assert s.run("cd /tmp && export KV=1").exit_code == 0
        assert s.run("pwd; echo $KV").output.split() == ["/tmp", "1"]
        net = s.run("python3 -c \"import socket; socket.create_connection(('1.1.1.1', 80), timeout=5)\"")
        assert net.exit_code != 0 and "unreachable" in net.output.lower()
        slow = s.run("sleep 600", timeout=2)
        assert slow.timed_out and s.run("echo alive").output.strip() == "alive"
    finally:
        container.close()

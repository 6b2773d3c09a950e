"""Worker pools are sized by the CPUs the process may use, not the machine's count."""

import os
import subprocess
import sys

import pytest


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux-only")
def test_usable_cpus_follows_the_affinity_not_the_machine():
    from envs.cpus import usable_cpus

    assert usable_cpus() == len(os.sched_getaffinity(0)) >= 1
    # a process pinned to one CPU (a container's cpuset, taskset) sizes its pools at 1 whatever the machine has
    code = "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); from envs.cpus import usable_cpus; " \
           "print(usable_cpus(), os.cpu_count())"
    one, machine = map(int, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                           cwd=os.path.dirname(os.path.dirname(__file__))).stdout.split())
    assert one == 1 and machine == os.cpu_count()

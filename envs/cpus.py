"""How many CPUs this process may run on: what the worker pools (game generators, expert players, corpus threads,
SWE builders) are sized by."""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """The CPUs this process may be scheduled on (its affinity: a container's cpuset, ``taskset``), at least 1.
    ``os.cpu_count`` counts the machine's, which in a container can be many more than it was given."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no affinity outside Linux
        return max(1, os.cpu_count() or 1)

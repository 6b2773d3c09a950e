"""The scheduler process entry point SGLang spawns, with our patches installed first.

SGLang runs its scheduler in a spawned process, so patches made in the launching process
do not reach it; ``Engine`` / ``launch_server`` accept ``run_scheduler_process_func``, a
top-level (picklable) function, and this is ours.
"""

from __future__ import annotations


def run_scheduler_process(server_args, *args, **kwargs):
    from sglang.srt.managers.scheduler import run_scheduler_process as run

    from .patches import install
    from .sync_report import install_if_requested

    install(server_args)
    install_if_requested()
    return run(server_args, *args, **kwargs)

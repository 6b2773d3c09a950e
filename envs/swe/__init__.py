"""SWE tasks offline: real libraries with injected bugs, sandboxed tools, SWE-bench grading.

The data path: ``builder`` (library sdist -> mutated task repositories + ``SweInstance`` JSONL)
-> ``SweTaskSet`` -> ``SweEnv`` (``workspace`` checkout, ``sandbox`` jail, ``session`` bash,
``editor``, ``actions`` protocol) -> ``grading`` on submit.
"""

from .actions import SYSTEM_PROMPT, parse_action
from .builder import BuildConfig, LibraryReport, build
from .env import SweEnv, SweEnvConfig, SweTaskSet, swe_compaction
from .grading import Grade, evaluate, grade_statuses
from .instance import InstanceFileError, SweInstance, load_instances, write_instances
from .libraries import LIBRARIES, Library
from .sandbox import Limits, Sandbox, SandboxUnavailable
from .session import BashSession, CommandResult
from .workspace import TaskRepos

__all__ = ["LIBRARIES", "SYSTEM_PROMPT", "BashSession", "BuildConfig", "CommandResult", "Grade", "InstanceFileError",
           "Library", "LibraryReport", "Limits", "Sandbox", "SandboxUnavailable", "SweEnv", "SweEnvConfig",
           "SweInstance", "SweTaskSet", "TaskRepos", "build", "evaluate", "grade_statuses", "load_instances",
           "parse_action", "swe_compaction", "write_instances"]

"""One SWE task in the SWE-bench schema, and its JSONL file format.

Fields are SWE-bench's, so the same loader reads instances exported from SWE-bench, SWE-bench
Verified, SWE-rebench or SWE-smith as well as the ones the offline builder writes. Two quirks of
the published datasets are accepted: ``FAIL_TO_PASS``/``PASS_TO_PASS`` stored as a JSON-encoded
string of a list, and ``version`` stored as a number. Unknown fields (``created_at``,
``hints_text``, ``image_name``, ...) are kept, so a file round-trips unchanged.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

DEFAULT_TEST_CMD = "python -m pytest -rA --tb=short -p no:cacheprovider"


class SweInstance(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    instance_id: str = Field(min_length=1)
    repo: str = Field(min_length=1, description="owner/name; offline tasks use pypi/<library>")
    base_commit: str = Field(min_length=1, description="the commit the agent starts from (the bug is in it)")
    patch: str = Field(description="gold fix, a git diff against base_commit")
    test_patch: str = Field(description="git diff restoring the hidden tests; applied only at grading")
    problem_statement: str = Field(min_length=1)
    FAIL_TO_PASS: list[str] = Field(min_length=1)
    PASS_TO_PASS: list[str]
    version: str
    # Not in SWE-bench (its harness keeps these per repo/version); the offline builder sets them.
    test_cmd: str = Field(DEFAULT_TEST_CMD, description="runs the listed test files; must print pytest -rA lines")
    python_path: str = Field(".", description="directory (relative to the repo root) put on PYTHONPATH")

    @field_validator("FAIL_TO_PASS", "PASS_TO_PASS", mode="before")
    @classmethod
    def _decode_json_list(cls, v):
        if isinstance(v, str):  # SWE-bench on the Hugging Face hub stores these as JSON text
            try:
                v = json.loads(v)
            except json.JSONDecodeError as e:
                raise ValueError(f"expected a list of test ids or a JSON-encoded list, got {v[:80]!r}") from e
        return v

    @field_validator("version", mode="before")
    @classmethod
    def _version_as_text(cls, v):
        return str(v) if isinstance(v, int | float) else v

    @property
    def test_files(self) -> list[str]:
        """Test files holding the graded tests (the files SWE-bench's harness runs)."""
        return sorted({t.split("::", 1)[0] for t in self.FAIL_TO_PASS + self.PASS_TO_PASS})


class InstanceFileError(ValueError):
    """A JSONL line that is not valid JSON or not a valid instance; names the file and line."""


def load_instances(path: str | Path) -> list[SweInstance]:
    path = Path(path)
    if not path.is_file():
        raise InstanceFileError(f"{path}: no such file")
    out, seen = [], set()
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise InstanceFileError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno})") from e
        if not isinstance(record, dict):
            raise InstanceFileError(f"{path}:{n}: expected a JSON object, got {type(record).__name__}")
        try:
            instance = SweInstance.model_validate(record)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or '<record>'}: {err['msg']}" for err in e.errors())
            name = record.get("instance_id", "?")
            raise InstanceFileError(f"{path}:{n}: instance {name!r} is invalid: {problems}") from e
        if instance.instance_id in seen:
            raise InstanceFileError(f"{path}:{n}: duplicate instance_id {instance.instance_id!r}")
        seen.add(instance.instance_id)
        out.append(instance)
    return out


def write_instances(path: str | Path, instances: Iterable[SweInstance]) -> None:
    """Write JSONL atomically: a reader sees the old file or the whole new one, never a prefix."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            for inst in instances:
                f.write(json.dumps(inst.model_dump(), ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise

"""Atomic checkpoints: a crash mid-write never leaves a checkpoint that looks complete.

Each checkpoint is one file written to a temporary name, fsynced and renamed into place
(``os.replace`` is atomic on POSIX); ``latest`` is updated the same way afterwards.

A checkpoint can still go bad after it was written (a full disk, a copy cut short, a
hand edit): loading checks each file and falls back to the newest intact one, saying
which file was skipped and why, instead of surfacing whatever the unpickler hit
(``MemoryError`` on a garbage frame length, ``EOFError``, ``IsADirectoryError``...).
"""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
import zipfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_NAME = re.compile(r"step_(\d{6,})\.pt")


class CorruptCheckpoint(RuntimeError):
    """A checkpoint file that cannot be loaded; the message names the file and what is wrong."""


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


def save(directory: str | Path, step: int, payload: dict, *, keep: int | None = None) -> Path:
    """Write step ``step``'s checkpoint and point ``latest`` at it; with ``keep``, step files beyond the newest
    ``keep`` up to ``step`` are then deleted (loading falls back to an older intact one, so keep at least 2 to have
    one).

    Step files above ``step`` are a cut run's, past the checkpoint it resumed from (``latest`` named a damaged
    file): they go too, or "the newest ``keep``" could delete the file just written and a later fallback would
    load the abandoned run."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step_{step:06d}.pt"
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save({**payload, "step": step, "rng": rng_state()}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    atomic_write_bytes(directory / "latest", path.name.encode())
    prune(_step_files(directory), path, keep)
    return path


def prune(versions: list[Path], current: Path, keep: int | None) -> None:
    """Of ``versions`` (newest first), delete those above ``current`` -- a cut run's, past the point its resumed
    run started from -- and those beyond the ``keep`` newest from ``current`` down (None: keep them)."""
    at = versions.index(current)
    for old in versions[:at] + (versions[at + keep:] if keep is not None else []):
        shutil.rmtree(old) if old.is_dir() else old.unlink(missing_ok=True)


def read(path: Path) -> dict:
    """One checkpoint's payload, or ``CorruptCheckpoint`` naming the file.

    ``torch.save`` writes a zip archive; anything else (truncated: no central directory at
    the end; overwritten) is refused before the unpickler sees it, since garbage can make it
    allocate a made-up frame length."""
    if not path.is_file():
        raise CorruptCheckpoint(f"checkpoint {path} is {'not a file' if path.exists() else 'missing'}")
    if not zipfile.is_zipfile(path):
        raise CorruptCheckpoint(f"checkpoint {path} is not a torch checkpoint (truncated or overwritten: "
                                f"{path.stat().st_size} bytes, no zip directory)")
    try:
        state = torch.load(path, weights_only=False)
    except Exception as e:  # a damaged member passes the zip check; torch and pickle raise many kinds
        raise CorruptCheckpoint(f"checkpoint {path} cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int) or "rng" not in state:
        raise CorruptCheckpoint(f"checkpoint {path} does not hold a step and an RNG state (not written by save)")
    return state


def _step_files(directory: Path) -> list[Path]:
    """``step_*.pt`` entries, newest step first (files or not: a directory in place of one is
    reported, not skipped silently)."""
    named = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.fullmatch(p.name))]
    return [p for _, p in sorted(named, reverse=True)]


def _pointed(directory: Path) -> Path | None:
    """The checkpoint ``latest`` names, or None (with a warning) when it names none usable."""
    pointer = directory / "latest"
    if not pointer.exists():
        return None
    try:
        name = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        log.warning("checkpoint pointer %s is unreadable (%s); using the newest step file", pointer, e)
        return None
    if not _NAME.fullmatch(name):
        log.warning("checkpoint pointer %s names %r, not a step_NNNNNN.pt file; using the newest step file",
                    pointer, name)
        return None
    return directory / name


def load_latest(directory: str | Path) -> dict | None:
    """The newest intact checkpoint: the one ``latest`` names, else the highest step that loads.

    None when there is no checkpoint at all; ``CorruptCheckpoint`` listing every file when
    there are some and none loads. Each file skipped is logged with why."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    pointed = _pointed(directory)
    candidates = ([pointed] if pointed is not None else []) + [p for p in _step_files(directory) if p != pointed]
    if not candidates:
        return None
    problems = []
    for path in candidates:
        try:
            state = read(path)
        except CorruptCheckpoint as e:
            problems.append(f"{e} (named by {directory / 'latest'})" if path == pointed else str(e))
            log.warning("%s", problems[-1])
            continue
        if path != pointed:
            log.warning("falling back to %s, the newest intact checkpoint", path)
        return state
    raise CorruptCheckpoint(f"no intact checkpoint in {directory}: " + "; ".join(problems))


def has_checkpoint(directory: str | Path) -> bool:
    """Whether ``directory`` holds anything to resume from (intact or not: loading says which)."""
    directory = Path(directory)
    return directory.is_dir() and (bool(_step_files(directory)) or (directory / "latest").exists())

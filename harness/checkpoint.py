"""Atomic checkpoints: a crash mid-write never leaves a checkpoint that looks complete.

Each checkpoint is one file written to a temporary name, fsynced and renamed into place
(``os.replace`` is atomic on POSIX); ``latest`` is updated the same way afterwards.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import torch


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


def save(directory: str | Path, step: int, payload: dict) -> Path:
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
    return path


def load_latest(directory: str | Path) -> dict | None:
    directory = Path(directory)
    pointer = directory / "latest"
    if not pointer.exists():
        return None
    return torch.load(directory / pointer.read_text().strip(), weights_only=False)

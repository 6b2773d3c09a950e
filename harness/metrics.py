"""Per-step metrics as JSONL (appended and fsynced line by line) plus PNG plots."""

from __future__ import annotations

import json
import os
from pathlib import Path

PLOTTED = ["reward", "win_rate", "tokens_reprefilled", "peak_live_kv_tokens", "mismatch_abs", "mismatch_kl",
           "tis_clip_frac", "tokens_per_s", "rollout_s", "train_s"]


class MetricsLog:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def rows(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def truncate_after(self, step: int) -> None:
        """On resume: forget steps the checkpoint does not cover (they will be redone)."""
        keep = [r for r in self.rows() if r["step"] <= step]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
        os.replace(tmp, self.path)

    def log(self, row: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def plot(self, out: str | Path, keys: list[str] | None = None) -> Path:
        """One panel per metric of ``keys`` (default: the RL metrics ``PLOTTED``) over steps."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = self.rows()
        keys = [k for k in (keys or PLOTTED) if any(k in r for r in rows)]
        fig, axes = plt.subplots(len(keys), 1, figsize=(7, 1.8 * max(1, len(keys))), sharex=True, squeeze=False)
        for ax, key in zip(axes[:, 0], keys, strict=True):
            pts = [(r["step"], r[key]) for r in rows if key in r]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".")
            ax.set_ylabel(key, fontsize=7)
        axes[-1, 0].set_xlabel("trainer step")
        fig.tight_layout()
        out = Path(out)
        fig.savefig(out, dpi=100)
        plt.close(fig)
        return out

"""ALFWorld game files: where the release data is, and each game rebuilt with the installed
package's logic.

Source: ``$ALFWORLD_DATA/json_2.1.1`` when it exists (what ``alfworld-download`` fills),
otherwise the shared archive ``../shared/data/alfworld/alfworld-json_2.1.1-solvable.tar.xz``
(relative to the repository) extracted once into the cache.

Text variant: every ``game.tw-pddl`` is rebuilt from the trial's ``initial_state.pddl`` and
``traj_data.json`` with the PDDL domain and text grammar *of the installed alfworld package*,
as ``alfworld-generate`` does. The games then read "You arrive at shelf 1." and place
objects with "move X to Y"; the release files say "You arrive at loc 19." and "put X in/on Y".
The installed package's hand-coded expert only ever says "move X to Y": on the release files
its placing commands are never admissible and it wins only when a random fallback places the
object (10/20 and 16/20 of the seen and unseen samples the tests use; 20/20 and 20/20 rebuilt).
Rebuilt games go to ``<cache>/alfworld/games-<fingerprint>/`` (the source is never written),
next to a link to their ``traj_data.json``, which the expert reads. The goal's wording ("examine
the book with the desklamp" / "look at book under the desklamp") is one of the task type's
templates, which the package draws from the global ``random``; it is drawn here from a seed of
the trial's id, so that every machine builds the same game (unseeded, the device's train games
and a CPU box's differed: 5 of the first 12 wordings).

Splits: ``train`` = ``valid_train`` (200 games in the shared archive; point
``train_dir`` at ``train`` for the full ~3.5k download), each with ``train_variants`` more games
of its room with the objects placed again (``variants.py``), ``eval_seen`` = ``valid_seen``
(140), ``eval_unseen`` = ``valid_unseen`` (134), ``eval`` = both.

CLI (extract and rebuild everything ahead of time)::

    python -m envs.alfworld.data
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import random
import tarfile
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from tqdm import tqdm

from .variants import VARIANTS_BUILD, variant_problem

REPO = Path(__file__).resolve().parents[2]
ARCHIVE = REPO.parent / "shared" / "data" / "alfworld" / "alfworld-json_2.1.1-solvable.tar.xz"
RELEASE = "json_2.1.1"
EVAL_DIRS = {"eval_seen": ("valid_seen",), "eval_unseen": ("valid_unseen",), "eval": ("valid_seen", "valid_unseen")}
# The six ALFRED task types ALFWorld plays; trials with movable receptacles or sliced objects
# have no text version (the package's AlfredTWEnv skips them too).
TASK_TYPES = ("pick_and_place_simple", "look_at_obj_in_light", "pick_clean_then_place_in_recep",
              "pick_heat_then_place_in_recep", "pick_cool_then_place_in_recep", "pick_two_obj_and_place")


def default_cache_dir() -> Path:
    return Path(os.environ.get("KVSTREAMS_CACHE", "~/.cache/kvstreams")).expanduser() / "alfworld"


def source_root(cache_dir: Path, archive: Path = ARCHIVE) -> Path:
    """The ``json_2.1.1`` folder: ``$ALFWORLD_DATA``'s when it has one, else the extracted archive.
    (Only a folder holding the release counts: importing ``alfworld`` sets the variable to an
    empty default when it is unset.)"""
    env = os.environ.get("ALFWORLD_DATA")
    if env and (Path(env) / RELEASE).is_dir():
        return Path(env) / RELEASE
    return extract(archive, Path(cache_dir)) / RELEASE


def extract(archive: Path, dest: Path) -> Path:
    """Unpack ``archive`` into ``dest`` once; a completed extraction leaves a stamp."""
    stamp = dest / f".extracted-{Path(archive).name}"
    if stamp.exists():
        return dest
    if not Path(archive).exists():
        raise FileNotFoundError(f"ALFWorld data: {archive} is missing and $ALFWORLD_DATA has no {RELEASE}/")
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest, prefix=".extract-") as tmp:
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        for entry in Path(tmp).iterdir():
            target = dest / entry.name
            if target.exists():
                continue  # a concurrent extraction got there first: same bytes
            os.replace(entry, target)
    stamp.touch()
    return dest


def trial_dirs(root: Path, folder: str) -> list[Path]:
    """The playable trials of one release folder, sorted: a known task type, no movable
    receptacle or slicing, and not marked unsolvable by the release's game file."""
    trials = []
    for traj in sorted((Path(root) / folder).glob("*/*/traj_data.json")):
        trial = traj.parent
        if "movable" in str(trial) or "Sliced" in str(trial):
            continue
        if not trial.parent.name.startswith(TASK_TYPES):
            continue
        ref = trial / "game.tw-pddl"
        if ref.exists() and not json.loads(ref.read_text()).get("solvable", True):
            continue
        trials.append(trial)
    return trials


@dataclass(frozen=True)
class GameLogic:
    """The installed package's PDDL domain and text grammar."""

    domain: str
    grammar: str

    @classmethod
    def installed(cls) -> GameLogic:
        from alfworld.info import ALFRED_PDDL_PATH, ALFRED_TWL2_PATH

        return cls(Path(ALFRED_PDDL_PATH).read_text(), Path(ALFRED_TWL2_PATH).read_text())

    @cached_property
    def fingerprint(self) -> str:
        return hashlib.sha256((self.domain + "\0" + self.grammar + "\0" + BUILD).encode()).hexdigest()[:8]


BUILD = "goal wording seeded by trial id"  # how build_game makes a game; in the games' folder name
_GLOBAL_RANDOM = threading.Lock()  # build_game seeds and restores the global `random` the package draws from


def trial_seed(trial_id: str) -> int:
    """A game's random draws (its goal's wording, a variant's placements) come from this seed of its id."""
    return int.from_bytes(hashlib.sha256(trial_id.encode()).digest()[:8], "big")


def build_game(trial: Path, out: Path, logic: GameLogic, trial_id: str,
               problem: Callable[[], str] | None = None) -> Path:
    """Write ``out/game.tw-pddl`` for ``trial`` (as ``alfworld-generate`` does, the goal's wording drawn from
    a seed of ``trial_id``; the problem ``problem()``, else the trial's ``initial_state.pddl``) and link its
    ``traj_data.json`` beside it; a no-op when it is already there."""
    game = out / "game.tw-pddl"
    if game.exists():
        return game
    from alfworld.agents.utils.misc import add_task_to_grammar

    traj = trial / "traj_data.json"
    out.mkdir(parents=True, exist_ok=True)
    with _GLOBAL_RANDOM:  # get_templated_task_desc draws from the global `random`, whatever rng it is given
        state = random.getstate()
        random.seed(trial_seed(trial_id))
        try:
            grammar = add_task_to_grammar(logic.grammar, json.loads(traj.read_text()), rng=random.Random(0))
        finally:
            random.setstate(state)
    gamedata = dict(pddl_domain=logic.domain, grammar=grammar,
                    pddl_problem=problem() if problem else (trial / "initial_state.pddl").read_text(), solvable=True)
    link = out / "traj_data.json"
    if not link.exists():
        try:
            link.symlink_to(traj.resolve())
        except FileExistsError:
            pass
    fd, tmp = tempfile.mkstemp(dir=out, prefix=".game-")
    with os.fdopen(fd, "w") as f:
        json.dump(gamedata, f)
    os.replace(tmp, game)  # atomic: a reader never sees half a game
    return game


class GameFiles:
    """Maps split names to rebuilt game files."""

    def __init__(self, cache_dir: Path | None = None, archive: Path = ARCHIVE, train_dir: str = "valid_train",
                 train_variants: int = 0):
        if train_variants < 0:
            raise ValueError(f"train_variants must be >= 0, got {train_variants}")
        self.cache_dir = Path(cache_dir or default_cache_dir())
        self.archive, self.train_dir, self.train_variants = Path(archive), train_dir, train_variants

    @cached_property
    def root(self) -> Path:
        return source_root(self.cache_dir, self.archive)

    @cached_property
    def logic(self) -> GameLogic:
        return GameLogic.installed()

    @property
    def games_dir(self) -> Path:
        return self.cache_dir / f"games-{self.logic.fingerprint}"

    @property
    def version(self) -> str:
        """What the rebuilt games depend on besides the release's files: the installed logic and ``BUILD`` (and how
        train variants are drawn, when there are any)."""
        variants = f"-{VARIANTS_BUILD}" if self.train_variants else ""
        return f"alfworld-{self.logic.fingerprint}{variants}"

    def folders(self, split: str) -> tuple[str, ...]:
        if split == "train":
            return (self.train_dir,)
        if split in EVAL_DIRS:
            return EVAL_DIRS[split]
        raise ValueError(f"unknown ALFWorld split {split!r}; expected train, {', '.join(EVAL_DIRS)}")

    def trials(self, split: str) -> list[Path]:
        return [t for folder in self.folders(split) for t in trial_dirs(self.root, folder)]

    def games(self, split: str, *, progress: bool = False) -> list[tuple[str, Path]]:
        """``(trial id, game file)`` for every playable trial of ``split``, rebuilding missing files; the train
        split's variants (``<trial id>#v<k>``) after its trials."""
        out, variants = [], []
        for trial in tqdm(self.trials(split), desc=f"alfworld {split}", unit="game", disable=not progress):
            rel = trial.relative_to(self.root).as_posix()
            out.append((rel, build_game(trial, self.games_dir / rel, self.logic, rel)))
            for k in range(1, (self.train_variants if split == "train" else 0) + 1):
                vid = f"{rel}#v{k}"
                problem = functools.partial(variant_problem, trial, random.Random(trial_seed(vid)))
                variants.append((vid, build_game(trial, self.games_dir / VARIANTS_BUILD / rel / f"v{k}", self.logic,
                                                 vid, problem)))
        return out + variants


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Extract the ALFWorld data and rebuild its game files.")
    parser.add_argument("--cache-dir", type=Path, default=None, help=f"default: {default_cache_dir()}")
    parser.add_argument("--archive", type=Path, default=ARCHIVE)
    parser.add_argument("--train-dir", default="valid_train")
    parser.add_argument("--train-variants", type=int, default=0, help="more train games per trial (variants.py)")
    args = parser.parse_args(argv)
    files = GameFiles(args.cache_dir, args.archive, args.train_dir, args.train_variants)
    for split in ("train", "eval_seen", "eval_unseen"):
        print(f"{split}: {len(files.games(split, progress=True))} games in {files.games_dir}")


if __name__ == "__main__":
    main()

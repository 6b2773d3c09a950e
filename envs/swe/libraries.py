"""The real libraries tasks are built from: pinned source distributions that ship pytest suites.

Each is fetched once with ``pip download`` (sdist only, hash-checked, no dependencies) into a
cache directory and unpacked there; the unpacked tree, minus build droppings, becomes the clean
commit of the library's task repository. The pins (version and sha256) make a build
reproducible: same seed, same instances, same commit ids.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from pydantic import BaseModel, ConfigDict


class Library(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str  # the PyPI project
    version: str
    sha256: str  # of the sdist
    sources: tuple[str, ...]  # files or directories bugs are injected into, relative to the tree
    tests: tuple[str, ...]  # test directories or files, relative to the tree
    exclude: tuple[str, ...] = ()  # path prefixes never mutated (generated files, vendored code)
    python_path: str = "."  # put on PYTHONPATH so the tests import the tree, not an installed copy
    pytest_args: str = ""  # extra arguments for this suite under the current pytest

    @property
    def repo(self) -> str:
        return f"pypi/{self.name}"

    @property
    def test_cmd(self) -> str:
        from .instance import DEFAULT_TEST_CMD

        return f"{DEFAULT_TEST_CMD} {self.pytest_args}".strip()


LIBRARIES: dict[str, Library] = {lib.name: lib for lib in (
    Library(name="toolz", version="1.0.0",
            sha256="2c86e3d9a04798ac556793bced838816296a2f085017664e4995cb40a1047a02",
            sources=("toolz",), tests=("toolz/tests",), exclude=("toolz/tests", "toolz/_version.py")),
    Library(name="cachetools", version="5.5.2",
            sha256="1a661caa9175d26759571b2e19580f9d6393969e5dfca11fdb1f947a23e640d4",
            sources=("src/cachetools",), tests=("tests",), python_path="src"),
    Library(name="parse", version="1.20.2",
            sha256="b41d604d16503c79d81af5165155c0b20f6c8d6c559efa66b4b695c3e5a0a0ce",
            sources=("parse.py",), tests=("tests",)),
    Library(name="tabulate", version="0.9.0",
            sha256="0095b12bf5966de529c0feb1fa08671671b3368eec77d7ef7ab114be2c068b3c",
            sources=("tabulate",), tests=("test",), exclude=("tabulate/version.py",)),
    # boltons' conftest uses a pytest hook signature that pytest 9 removed; it only skips py2 files.
    Library(name="boltons", version="25.0.0",
            sha256="e110fbdc30b7b9868cb604e3f71d4722dd8f4dcb4a5ddd06028ba8f1ab0b5ace",
            sources=("boltons",), tests=("tests",), pytest_args="--noconftest"),
    # funcy's tests import `whatever`; marshmallow's import `simplejson` (both in the `swe` extra).
    Library(name="funcy", version="2.0",
            sha256="3963315d59d41c6f30c04bc910e10ab50a3ac4a225868bfa96feed133df075cb",
            sources=("funcy",), tests=("tests",)),
    Library(name="marshmallow", version="3.26.1",
            sha256="e6d8affb6cb61d39d26402096dc0aee12d5a26d490a121f118d2e81dc0719dc6",
            sources=("src/marshmallow",), tests=("tests",), exclude=("tests/mypy_test_cases",),
            python_path="src"),
    Library(name="more-itertools", version="10.7.0",
            sha256="9fddd5403be01a94b204faadcff459ec3568cf110265d3c54323e1e866ad29d3",
            sources=("more_itertools",), tests=("tests",)),
)}
DEFAULT_LIBRARIES = ("toolz", "cachetools", "parse", "tabulate", "boltons")


def default_cache_dir() -> Path:
    return Path(os.environ.get("KVSTREAMS_SWE_CACHE", Path.home() / ".cache" / "kvstreams" / "swe"))


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fetch_sdist(lib: Library, cache_dir: Path) -> Path:
    """The library's sdist in ``cache_dir/sdists``, downloaded by pip on first use."""
    dest = Path(cache_dir) / "sdists"
    dest.mkdir(parents=True, exist_ok=True)
    for path in dest.iterdir():
        if path.is_file() and _sha256(path) == lib.sha256:
            return path
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        req = Path(tmp) / "requirements.txt"
        req.write_text(f"{lib.name}=={lib.version} --hash=sha256:{lib.sha256}\n")
        # `--no-binary NAME` rather than `:all:`: the build backend that pip runs to read the
        # sdist's metadata may still come as a wheel.
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", lib.name,
               "--dest", tmp, "-r", str(req)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got = [p for p in Path(tmp).iterdir() if p.name != "requirements.txt"]
        if proc.returncode != 0 or len(got) != 1:
            raise RuntimeError(f"pip could not download the {lib.name}=={lib.version} sdist "
                               f"(exit {proc.returncode}):\n{proc.stderr[-2000:]}")
        final = dest / got[0].name
        os.replace(got[0], final)
    return final


def unpack_clean_tree(lib: Library, cache_dir: Path) -> Path:
    """The unpacked sdist without bytecode and egg-info: what the clean commit holds."""
    target = Path(cache_dir) / "trees" / f"{lib.name}-{lib.version}"
    done = target.parent / f"{target.name}.complete"
    if done.exists():
        return target
    sdist = fetch_sdist(lib, cache_dir)
    shutil.rmtree(target, ignore_errors=True)
    with tempfile.TemporaryDirectory(dir=Path(cache_dir)) as tmp:
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        (top,) = Path(tmp).iterdir()
        for junk in [*top.rglob("__pycache__"), *top.rglob("*.egg-info"), *top.rglob("*.pyc")]:
            if junk.is_dir():
                shutil.rmtree(junk, ignore_errors=True)
            elif junk.exists():
                junk.unlink()
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(top, target)
    done.touch()
    return target

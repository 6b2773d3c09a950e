"""Strip the debug sections off the ELF libraries of a wheel built here, in place, its RECORD rewritten to match.

Why: fast-downward-textworld (ALFWorld's PDDL planner) is an sdist; the wheel pip builds from it carries
``libdownward.so`` with its debug info: 33.8 MB unpacked, most of the wheel's 12 MB. Stripped (``strip
--strip-unneeded``: the dynamic symbols ctypes looks up stay) it is 1.1 MB, and ALFWorld's environment fits one
device carry beside the SGLang bundle (``bench/device/env_bundle.sh OUT alfworld``).

    python bench/device/strip_wheel.py WHEEL [WHEEL ...]
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def strip_wheel(wheel: Path) -> tuple[int, int]:
    """Strip every ELF member of ``wheel`` (rewritten in place, RECORD updated); returns (bytes before, after)."""
    before = wheel.stat().st_size
    with zipfile.ZipFile(wheel) as z:
        members = [(info, z.read(info)) for info in z.infolist()]
    stripped = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (info, data) in enumerate(members):
            if data[:4] == b"\x7fELF":
                path = Path(tmp) / f"{i}.so"
                path.write_bytes(data)
                subprocess.run(["strip", "--strip-unneeded", str(path)], check=True)
                stripped[info.filename] = path.read_bytes()
    if not stripped:
        return before, before
    records = [m for m in members if m[0].filename.endswith(".dist-info/RECORD")]
    out = {info.filename: stripped.get(info.filename, data) for info, data in members}
    for info, data in records:
        rows = list(csv.reader(io.StringIO(data.decode())))
        for row in rows:
            if row and row[0] in stripped:
                row[1], row[2] = _record_hash(stripped[row[0]]), str(len(stripped[row[0]]))
        text = io.StringIO()
        csv.writer(text, lineterminator="\n").writerows(rows)
        out[info.filename] = text.getvalue().encode()
    tmp_wheel = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(tmp_wheel, "w", zipfile.ZIP_DEFLATED) as z:
        for info, _ in members:
            z.writestr(info, out[info.filename], compress_type=zipfile.ZIP_DEFLATED)
    tmp_wheel.replace(wheel)
    return before, wheel.stat().st_size


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        b, a = strip_wheel(Path(arg))
        print(f"{Path(arg).name}: {b / 1e6:.1f} MB -> {a / 1e6:.1f} MB")

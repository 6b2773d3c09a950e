"""The GPU device's shell scripts (``bench/device/``) parse, and the JIT caches they carry between machines survive
a save on one "machine" and a restore on another (two temporary homes; no GPU needed)."""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((ROOT / "bench" / "device").glob("*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_device_script_parses(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


def test_jit_caches_travel_from_one_home_to_another(tmp_path):
    first, second, out = tmp_path / "first", tmp_path / "second", tmp_path / "out"
    for rel in (".cache/tvm-ffi/sgl_kernel_jit_qknorm/k.so", ".cache/flashinfer/f.so", ".triton/cache/ABC/k.cubin"):
        (first / rel).parent.mkdir(parents=True)
        (first / rel).write_text(rel)
    out.mkdir()
    (tmp_path / "repo" / ".devcache").mkdir(parents=True)
    save = f"source {ROOT}/bench/device/jit_cache.sh && jit_cache_save {out}"
    subprocess.run(["bash", "-c", save], check=True, env={"HOME": str(first), "PATH": "/usr/bin:/bin"})
    (out / "jit_cache.tar.xz").rename(tmp_path / "repo" / ".devcache" / "jit_cache.tar.xz")
    second.mkdir()
    restore = f"source {ROOT}/bench/device/jit_cache.sh && jit_cache_restore && jit_cache_restore"
    env = {"HOME": str(second), "PATH": "/usr/bin:/bin", "JIT_RESTORED": str(tmp_path / "restored")}
    done = subprocess.run(["bash", "-c", restore], check=True, cwd=tmp_path / "repo", env=env, capture_output=True,
                          text=True)
    assert done.stdout.count("JIT cache restored") == 1  # once per machine
    got = sorted(str(p.relative_to(second)) for p in second.rglob("*") if p.is_file())
    assert got == [".cache/flashinfer/f.so", ".cache/tvm-ffi/sgl_kernel_jit_qknorm/k.so", ".triton/cache/ABC/k.cubin"]


@pytest.mark.parametrize(("name", "card"), [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"), (None, "gpu")])
def test_results_are_named_after_the_card_the_call_got(tmp_path, name, card):
    """A call asked for either card may get an H100 or an H200: the scripts name their results by ``DEVICE_CARD``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if name is not None:  # a stand-in nvidia-smi printing the card's name as `--query-gpu=name` does
        smi = bin_dir / "nvidia-smi"
        smi.write_text(f"#!/bin/sh\necho '{name}'\n")
        smi.chmod(0o755)
    got = subprocess.run(["bash", "-c", "source bench/device/card.sh && echo $DEVICE_CARD"], check=True, cwd=ROOT,
                         env={"PATH": f"{bin_dir}:/usr/bin:/bin"}, capture_output=True, text=True)
    assert got.stdout.strip() == card


def test_the_sglang_bundles_wheels_repack_into_one_xz_tar_that_unpacks_as_installed(tmp_path):
    """``sglang_bundle_xz.sh`` turns the bundle's ``tf/*.whl`` into ``tf_site.tar.xz`` (what ``bundle.sh`` unpacks
    into the site folder): the wheels' files, nothing else, and the wheels gone (the carry is what shrinks)."""
    import sys
    import tarfile
    import zipfile

    out = tmp_path / ".device_sgl"
    (out / "tf").mkdir(parents=True)
    for name, files in {"pkg_a-1.0-py3-none-any.whl": {"pkg_a/__init__.py": "A = 1\n",
                                                       "pkg_a-1.0.dist-info/METADATA": "Name: pkg-a\n"},
                        "pkg_b-2.0-cp39-abi3-linux_x86_64.whl": {"pkg_b/_b.abi3.so": "\x7fELF"}}.items():
        with zipfile.ZipFile(out / "tf" / name, "w") as whl:
            for path, text in files.items():
                whl.writestr(path, text)
    subprocess.run(["bash", str(ROOT / "bench/device/sglang_bundle_xz.sh"), str(out)], check=True, cwd=tmp_path,
                   env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PYTHON": sys.executable},
                   capture_output=True)
    assert not (out / "tf").exists()
    with tarfile.open(out / "tf_site.tar.xz") as tar:
        got = sorted(m.name.removeprefix("./") for m in tar.getmembers() if m.isfile())
        site = tmp_path / "site"
        tar.extractall(site, filter="data")
    assert got == ["pkg_a-1.0.dist-info/METADATA", "pkg_a/__init__.py", "pkg_b/_b.abi3.so"]
    assert (site / "pkg_a" / "__init__.py").read_text() == "A = 1\n"
    again = subprocess.run(["bash", str(ROOT / "bench/device/sglang_bundle_xz.sh"), str(out)], cwd=tmp_path,
                           capture_output=True, text=True)
    assert again.returncode == 1 and "packed already" in again.stdout


def test_strip_wheel_drops_debug_info_and_keeps_the_library_loadable(tmp_path):
    """``strip_wheel.py`` (the ALFWorld bundle's fast-downward wheel, 12 MB -> 0.5 MB): the ELF member loses its debug
    sections, RECORD gives the new bytes' hash and size, and ctypes still finds its symbol."""
    import base64
    import csv
    import ctypes
    import hashlib
    import io
    import shutil
    import sys
    import zipfile

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or shutil.which("strip") is None:
        pytest.skip("needs a C compiler and strip (the project's setup builds fast-downward with them)")
    src = tmp_path / "lib.c"
    src.write_text("int answer(void) { static int table[4096] = {42}; return table[0]; }\n")
    lib = tmp_path / "libanswer.so"
    subprocess.run([cc, "-g3", "-O0", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("pkg/__init__.py", "")
        z.write(lib, "pkg/libanswer.so")
        z.writestr("pkg-1.0.dist-info/RECORD", f"pkg/__init__.py,,\npkg/libanswer.so,sha256=old,{lib.stat().st_size}\n"
                                               "pkg-1.0.dist-info/RECORD,,\n")
    sys.path.insert(0, str(ROOT / "bench" / "device"))
    try:
        from strip_wheel import strip_wheel
    finally:
        sys.path.pop(0)
    strip_wheel(wheel)
    with zipfile.ZipFile(wheel) as z:
        data = z.read("pkg/libanswer.so")
        record = {row[0]: row for row in csv.reader(io.StringIO(z.read("pkg-1.0.dist-info/RECORD").decode()))}
    assert len(data) < lib.stat().st_size
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    assert record["pkg/libanswer.so"][1:] == [f"sha256={digest}", str(len(data))]
    (tmp_path / "stripped.so").write_bytes(data)
    assert ctypes.CDLL(str(tmp_path / "stripped.so")).answer() == 42

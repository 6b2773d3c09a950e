"""`make setup` brings the system tools the tests need (bubblewrap, git, patch, util-linux) when it can:
as root with apt it installs the missing ones; otherwise it prints the command to run and setup goes on.
``STRICT=1`` (CI, ``make setup-swe``) fails instead. ``APT_GET`` stands in for apt-get here, so that
nothing is installed."""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MISSING = "SYSTEM_TOOLS=sh=dash kv-no-such-tool=kv-no-such-package"


def make(*args: str, as_nobody: bool = False) -> subprocess.CompletedProcess:
    drop = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if as_nobody and os.geteuid() == 0 else []
    return subprocess.run([*drop, "make", "-s", "-C", ROOT, *args], capture_output=True, text=True)


def test_nothing_happens_when_every_tool_is_there():
    r = make("system-tools", "SYSTEM_TOOLS=sh=dash")
    assert r.returncode == 0 and r.stdout == r.stderr == ""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("apt-get") is None, reason="needs root and apt")
def test_as_root_with_apt_the_missing_packages_are_installed():
    r = make("system-tools", MISSING, "APT_GET=echo apt-get")
    assert r.stdout.splitlines() == ["installing system tools: kv-no-such-package", "apt-get update -qq",
                                     "apt-get install -y -qq kv-no-such-package"]
    # the (pretend) install left the tool missing: the command is printed, setup goes on
    assert "apt-get install -y kv-no-such-package" in r.stderr and r.returncode == 0


@pytest.mark.skipif(os.geteuid() == 0 and shutil.which("setpriv") is None, reason="cannot drop root here")
def test_without_root_the_command_is_printed_and_setup_goes_on():
    r = make("system-tools", MISSING, as_nobody=True)
    assert r.returncode == 0 and "installing" not in r.stdout
    assert "system tools missing: kv-no-such-package. Install them with:" in r.stderr
    assert "sudo apt-get install -y kv-no-such-package" in r.stderr
    assert make("system-tools", MISSING, "STRICT=1", as_nobody=True).returncode != 0


def test_setup_and_setup_swe_go_through_it():
    for target, expected in (("setup", "command -v"), ("setup-swe", "system-tools STRICT=1")):
        r = make("-n", target, "VENV=/nonexistent-venv")
        assert r.returncode == 0 and expected in r.stdout, (target, r.stdout)

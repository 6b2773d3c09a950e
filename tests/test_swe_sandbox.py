"""The jail around every SWE command: no network, nothing writable but the worktree, time and
memory limits, and a bash session whose directory and variables persist between commands."""

import os
import time
from pathlib import Path

import pytest

from envs.swe.sandbox import Limits, Sandbox, SandboxUnavailable, bwrap_path
from envs.swe.session import BashSession

NOBODY = 65534  # the jail's uid and gid

needs_bwrap = pytest.mark.skipif(bwrap_path() is None,
                                 reason="bubblewrap not installed (apt-get install -y bubblewrap)")


def session(root: Path, **limits) -> BashSession:
    return BashSession(Sandbox(root, limits=Limits(**limits)), timeout_s=20)


def host_has_process(marker: str) -> bool:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" "):
                return True
        except OSError:
            pass
    return False


def test_missing_bubblewrap_is_a_clear_error(tmp_path):
    with pytest.raises(SandboxUnavailable, match="apt-get install -y bubblewrap"):
        Sandbox(tmp_path, bwrap="/nonexistent/bwrap")


@needs_bwrap
def test_network_is_unreachable(tmp_path):
    r = session(tmp_path).run(
        "python -c \"import socket; print(sorted(n for _, n in socket.if_nameindex()))\"; "
        "python -c \"import socket; socket.create_connection(('1.1.1.1', 80), timeout=5)\"")
    assert r.output.splitlines()[0] == "['lo']"  # a fresh network namespace: loopback only
    assert "Network is unreachable" in r.output and r.exit_code != 0


@needs_bwrap
def test_only_the_worktree_is_writable(tmp_path):
    tree, outside = tmp_path / "tree", tmp_path / "outside"
    tree.mkdir()
    outside.mkdir()
    s = session(tree)
    for target in ["/etc/kv_probe", "/usr/kv_probe", "/kv_probe", f"{outside}/kv_probe", f"{tree}/kv_probe"]:
        r = s.run(f"echo x > {target}")
        assert r.exit_code != 0, target
        assert "Read-only file system" in r.output or "No such file or directory" in r.output
    assert not list(outside.iterdir()) and not list(tree.iterdir())
    r = s.run(f"echo inside > /testbed/ok.txt && ls {outside}")
    assert "No such file or directory" in r.output  # other host paths are not even visible
    assert (tree / "ok.txt").read_text() == "inside\n"


@needs_bwrap
def test_tmp_is_private_and_emptied_after_each_command(tmp_path):
    s = session(tmp_path)
    name = f"kv_probe_{os.getpid()}"
    assert s.run(f"echo x > /tmp/{name} && cat /tmp/{name}").output.strip() == "x"
    assert not Path(f"/tmp/{name}").exists()
    assert s.run(f"cat /tmp/{name}").exit_code != 0


@needs_bwrap
def test_root_inside_has_no_capabilities(tmp_path):
    r = session(tmp_path).run("grep -E 'Cap(Eff|Prm|Amb)|NoNewPrivs' /proc/self/status; mount -o remount,rw / 2>&1; "
                              "echo x > /etc/kv_probe")
    assert "CapEff:\t0000000000000000" in r.output and r.exit_code != 0
    # nothing to regain either: no permitted or ambient capabilities, and exec cannot grant any (setuid bits and
    # file capabilities are ignored under no_new_privs)
    assert "CapPrm:\t0000000000000000" in r.output and "CapAmb:\t0000000000000000" in r.output
    assert "NoNewPrivs:\t1" in r.output
    assert not Path("/etc/kv_probe").exists()


@needs_bwrap
def test_a_runaway_command_is_killed_at_its_timeout_with_its_children(tmp_path):
    s = session(tmp_path)
    s.run("cd /tmp && export KV_MARK=1")
    start = time.monotonic()
    r = s.run("sleep 4711 & sleep 4712", timeout=1.0)
    assert r.timed_out and r.exit_code is None
    assert time.monotonic() - start < 5
    assert "timed out after 1s" in r.render(1.0)
    time.sleep(0.2)
    assert not host_has_process("sleep 4711") and not host_has_process("sleep 4712")
    after = s.run("pwd; echo $KV_MARK")
    assert after.output.split() == ["/tmp", "1"] and after.exit_code == 0  # the session goes on


@needs_bwrap
def test_memory_limit(tmp_path):
    r = session(tmp_path, memory_mb=512).run("python -c 'x = bytearray(1 << 30)'")
    assert "MemoryError" in r.output and r.exit_code == 1


@needs_bwrap
def test_directory_and_exports_persist_but_each_command_has_its_exit_code(tmp_path):
    s = session(tmp_path)
    assert s.run("mkdir -p a/b && cd a/b && export KV_X='two words'").exit_code == 0
    assert s.run("exit 7").exit_code == 7
    r = s.run('pwd; echo "$KV_X"')
    assert r.output.splitlines() == ["/testbed/a/b", "two words"]


@needs_bwrap
def test_long_output_is_cut_in_the_middle(tmp_path):
    s = BashSession(Sandbox(tmp_path), max_output_chars=1000)
    r = s.run("seq 1 100000")
    assert r.output.startswith("1\n2\n3\n") and r.output.rstrip().endswith("99999\n100000")
    assert "omitted" in r.output and r.omitted_chars > 500_000
    assert len(r.output) < 1200


@needs_bwrap
def test_commands_run_as_nobody_in_a_user_namespace_of_their_own(tmp_path):
    """Not root: root owns /etc/shadow (mode 0640) and would read it, capabilities or not."""
    r = session(tmp_path).run("id -u; id -g; cat /proc/self/uid_map; head -1 /etc/shadow; echo x > /testbed/new.txt")
    uid, gid, uid_map, *rest = r.output.splitlines()
    inside, outside, count = map(int, uid_map.split())
    assert (uid, gid) == (str(NOBODY), str(NOBODY)) and inside == NOBODY and count == 1
    assert outside != 0  # nobody inside is not root outside
    if Path("/etc/shadow").exists():
        assert "Permission denied" in rest[0]
    assert (tmp_path / "new.txt").stat().st_uid == outside


@needs_bwrap
def test_a_worktree_the_host_wrote_stays_writable(tmp_path):
    """The host (root, in CI) checks the tree out; the jail edits, creates and deletes in it."""
    (tmp_path / "private").mkdir(mode=0o700)
    (tmp_path / "private" / "secret.py").write_text("a = 1\n")
    (tmp_path / "private" / "secret.py").chmod(0o600)
    (tmp_path / "module.py").write_text("b = 2\n")
    r = session(tmp_path).run("echo 'a = 3' >> private/secret.py && touch private/new.py && rm module.py && "
                              "mkdir -p pkg/sub && echo ok > pkg/sub/f && cat private/secret.py")
    assert r.exit_code == 0, r.output
    assert r.output.splitlines() == ["a = 1", "a = 3"]
    assert (tmp_path / "pkg" / "sub" / "f").read_text() == "ok\n" and not (tmp_path / "module.py").exists()


@needs_bwrap
@pytest.mark.skipif(os.geteuid() != 0, reason="the tree is handed over to nobody only when running as root")
def test_handing_the_tree_over_never_follows_a_link_the_jail_left(tmp_path):
    tree, outside = tmp_path / "tree", tmp_path / "outside"
    tree.mkdir()
    outside.mkdir()
    (outside / "secret").write_text("host\n")
    s = session(tree)
    assert s.run(f"ln -s {outside / 'secret'} /testbed/link && ln -s {outside} /testbed/dir").exit_code == 0
    s.run("true")  # the next command hands the tree over again
    assert (outside / "secret").stat().st_uid == 0 and outside.stat().st_uid == 0
    assert (tree / "link").lstat().st_uid == NOBODY


FORK_LOOP = """
import os, time  # kv_fork_probe
n = 0
try:
    for _ in range(3000):
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        n += 1
except OSError as e:
    print(f"forked {n}: {e}")
    raise SystemExit(1)
print(f"forked {n}")
"""


@needs_bwrap
@pytest.mark.parametrize("limit", [64, "default"])
def test_a_fork_bomb_stops_at_max_processes(limit, tmp_path):
    limits = Limits() if limit == "default" else Limits(max_processes=limit)
    start = time.monotonic()
    r = BashSession(Sandbox(tmp_path, limits=limits), timeout_s=20).run(f"python -c '{FORK_LOOP}'")
    assert "Resource temporarily unavailable" in r.output and r.exit_code == 1, r.output  # before: forked 3000
    forked = int(r.output.split()[1].rstrip(":"))
    assert limits.max_processes - 8 <= forked < limits.max_processes  # the jail's own processes count too
    # the sleeping children die with the jail (the kernel kills a PID namespace's processes when its
    # init ends: that takes a moment for hundreds), not after their 60 s
    while host_has_process("kv_fork_probe"):
        assert time.monotonic() - start < 30
        time.sleep(0.1)


@needs_bwrap
@pytest.mark.parametrize("hog,message", [
    ("python -c 'chunks = []\nwhile True: chunks.append(bytearray(64 << 20))'", "MemoryError"),
    ("tail /dev/zero", "memory exhausted"),  # one line that never ends: tail buffers it all
])
def test_a_memory_hog_is_stopped_by_the_address_space_limit(hog, message, tmp_path):
    r = session(tmp_path, memory_mb=512).run(hog)
    assert message in r.output and r.exit_code == 1 and not r.timed_out, r.output

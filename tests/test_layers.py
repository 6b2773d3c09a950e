"""The packages are layers, bottom up, and imports only go down.

Every ``import`` statement of every module of the installed packages is read from its source
(lazy imports inside functions included: a lazy import hides a cycle, it does not remove it),
mapped to the layer unit it names, and checked against ``LAYERS``: a module may import its own
unit and the units below it, never one above. A unit listed later is a higher layer. The same
walk finds import cycles between modules, and production code importing the test helpers.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvstreams_sglang", "trainer_masks", "envs", "harness")

# Bottom up. A module belongs to the longest prefix listed here.
LAYERS = [
    "kvstreams_sglang.checkpoints",  # 0: offline model / tokenizer builders (no project imports)
    "trainer_masks",  # 1: stream: record, ledger, masks
    "kvstreams_sglang.kv4",  # 2: KV4 format and torch references
    "kvstreams_sglang.kernels",  # 2: Triton / CUDA kernels over that format
    "trainer_masks.scoring",  # 3: masked forward, logprobs, fp32 head, invariant attention
    "kvstreams_sglang.streams",  # 4: slots, pools, the engine's streams
    "kvstreams_sglang.engine",  # 4: the built-in engine
    "kvstreams_sglang.sglang_ext",  # 4: the SGLang integration
    "kvstreams_sglang.launch_server",
    "kvstreams_sglang.kv4_report",
    "envs.cpus",  # 5: the CPUs worker pools may use (no project imports)
    "envs.rollout",  # 5: agent loop, engine client, compaction, chat
    "envs.toy",  # 6: environments
    "envs.textworld",
    "envs.alfworld",
    "envs.swe",
    "envs.corpus",
    "envs.registry",
    "harness",  # 7
]
PACKAGE_ROOTS = {"kvstreams_sglang", "envs"}  # their __init__ must import nothing of the project
TEST_ONLY = "kvstreams_sglang.testing"


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def imports(name: str, path: Path) -> set[str]:
    """Project modules ``name`` imports (absolute names), from every import statement in it."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[:len(base) - node.level + (1 if is_pkg else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)  # `from pkg import submodule`
    return {m for m in found if m.split(".")[0] in PACKAGES}


def unit(name: str) -> str | None:
    best = None
    for u in LAYERS + [TEST_ONLY]:
        if (name == u or name.startswith(u + ".")) and (best is None or len(u) > len(best)):
            best = u
    return best


def rank(u: str) -> int:
    return LAYERS.index(u)


def resolve(target: str, known: dict[str, Path]) -> str | None:
    """The module a dotted import name refers to (``pkg.mod.attr`` -> ``pkg.mod``)."""
    while target and target not in known:
        target = target.rpartition(".")[0]
    return target or None


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: {t for t in (resolve(i, known) for i in imports(name, path)) if t and t != name}
            for name, path in known.items()}


def test_every_module_is_in_a_layer():
    missing = [m for m in modules() if unit(m) is None and m not in PACKAGES]
    assert not missing, f"modules in no layer of LAYERS: {missing}"


def test_imports_only_go_down():
    upward = []
    for src, targets in graph().items():
        if src in PACKAGES:
            if src in PACKAGE_ROOTS and targets:
                upward.append(f"{src} (package root) imports {sorted(targets)}")
            continue
        us = unit(src)
        if us == TEST_ONLY:
            continue
        for t in targets:
            ut = unit(t)
            if ut == TEST_ONLY:
                upward.append(f"{src} imports the test helpers {t}")
            elif ut is not None and rank(ut) > rank(us):
                upward.append(f"{src} [{us}] imports {t} [{ut}]")
    assert not upward, "upward imports:\n" + "\n".join(sorted(upward))


def test_no_import_cycles():
    g = graph()
    # A package's __init__ re-exporting its submodules is the one allowed back edge (importing a
    # submodule runs its package's __init__ first, not the other way round).
    edges = {s: {t for t in ts if not (s.startswith(t + ".") and t in g)} for s, ts in g.items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                cycles.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(edges):
        if n not in state:
            visit(n)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)

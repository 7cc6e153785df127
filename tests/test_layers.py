"""The package's layers: every module imports only from layers below it.

All imports count: module level, inside functions, and under ``TYPE_CHECKING``. The
layers, bottom to top, are the contract of docs/architecture.md; a new module must be
placed on one here, or this test fails.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "aionixl"

#: Bottom first. A module may import modules of strictly lower layers only.
LAYERS: list[tuple[str, set[str]]] = [
    ("the NIXL agent's protocol", {"_agent"}),
    ("foundation", {"_errors", "_config", "_ratelimit", "_checks", "_lines", "_parking", "_zmq",
                    "_regions", "_notifications", "_results", "_parts"}),
    ("wire, and memory of our own", {"_protocol", "_wire", "_nixl", "_metrics", "_discovery", "_staging",
                                     "_shared"}),
    ("wire above the handshake's", {"_vllm_wire", "_hostfacts", "_vllm_sidecar"}),
    ("shared state: lifecycle and local side, leases", {"_lifecycle", "_peer", "_leases"}),
    ("shared state: the in-flight table", {"_inflight"}),
    ("components: peers", {"_peers"}),
    ("components: the direct path and its fence", {"_post"}),
    ("components: coalescing, push, handshakes, vLLM client and server",
     {"_coalesce", "_push", "_handshake", "_vllm_connect", "_vllm_serve"}),
    ("components: parts of blocks", {"_partial"}),
    ("components: the transfer call, the drainer", {"_transfers", "_drainer"}),
    ("facade", {"_engine"}),
    ("public surface", {"__init__", "vllm", "prometheus", "layouts", "lowlevel"}),
    ("vLLM's KV connector (imports vLLM; loaded by vLLM by module path)", {"vllm_connector"}),
    ("test helpers", {"testing"}),
    ("add-ons", {"_demo", "_bench", "_soak"}),
    ("command line", {"_cli"}),
    ("python -m aionixl", {"__main__"}),
]


def _module_of(path: Path) -> str:
    """The top-level module a file belongs to, within the package (``_bench`` for any file
    of that subpackage)."""
    rel = path.relative_to(PACKAGE)
    return rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 else rel.stem


def _imported(path: Path) -> set[str]:
    """Top-level modules of the package that ``path`` imports, in any way."""
    tree = ast.parse(path.read_text(), str(path))
    rel = path.relative_to(PACKAGE)
    depth = len(rel.parts) - 1  # 0 for aionixl/x.py, 1 for aionixl/sub/x.py
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "aionixl" and len(parts) > 1:
                    found.add(parts[1])
                elif parts[0] == "aionixl":
                    found.add("__init__")
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                parts = (node.module or "").split(".")
                if parts[0] != "aionixl":
                    continue
                names = parts[1:] or [alias.name for alias in node.names]
            else:
                if node.level - 1 > depth:
                    continue
                up = node.level - 1  # how far above this file's folder
                base = list(rel.parts[:-1])[: len(rel.parts) - 1 - up]
                parts = [*base, *(node.module.split(".") if node.module else [])]
                # "from . import x" in the package root names modules x
                names = [parts[0]] if parts else [alias.name for alias in node.names]
            for name in names:
                found.add(name if (PACKAGE / name).is_dir() or (PACKAGE / f"{name}.py").exists()
                          else "__init__")
    return found


def _layer_of() -> dict[str, int]:
    where: dict[str, int] = {}
    for index, (_, modules) in enumerate(LAYERS):
        for module in modules:
            assert module not in where, f"{module} is on two layers"
            where[module] = index
    return where


FILES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_of_the_package_is_on_a_layer() -> None:
    where = _layer_of()
    missing = sorted({_module_of(f) for f in FILES} - set(where))
    assert not missing, f"modules on no layer (add them to LAYERS): {missing}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_a_module_imports_only_from_layers_below(path: Path) -> None:
    where = _layer_of()
    mine = _module_of(path)
    upward = sorted(m for m in _imported(path) - {mine} if where.get(m, -1) >= where[mine])
    assert not upward, (f"{path.relative_to(PACKAGE)} ({LAYERS[where[mine]][0]}) imports "
                        + ", ".join(f"{m} ({LAYERS[where[m]][0]})" for m in upward))


def test_the_import_graph_of_the_package_has_no_cycle() -> None:
    """Module by module (subpackages' files each count): no import path leads back."""
    graph: dict[str, set[str]] = {}
    for path in FILES:
        rel = path.relative_to(PACKAGE)
        node = ".".join(rel.with_suffix("").parts)
        graph[node] = set()
    for path in FILES:
        rel = path.relative_to(PACKAGE)
        node = ".".join(rel.with_suffix("").parts)
        graph[node] = _file_imports(path, set(graph))
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = [*stack[stack.index(nxt):], nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def _file_imports(path: Path, nodes: set[str]) -> set[str]:
    """The package's files ``path`` imports: ``x`` for x.py, ``sub.__init__`` for a
    package; ``from M import name`` counts M, and also M.name where that is a module."""
    rel = path.relative_to(PACKAGE)
    folder = list(rel.parts[:-1])
    tree = ast.parse(path.read_text(), str(path))
    out: set[str] = set()

    def resolve(parts: list[str]) -> str | None:
        name = ".".join(parts) if parts else ""
        if f"{name}.__init__".lstrip(".") in nodes:
            return f"{name}.__init__".lstrip(".")
        return name if name in nodes else None

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "aionixl":
                    target = resolve(parts[1:])
                    if target is not None:
                        out.add(target)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                parts = (node.module or "").split(".")
                if parts[0] != "aionixl":
                    continue
                base = parts[1:]
            else:
                base = folder[: len(folder) - (node.level - 1)] + \
                    (node.module.split(".") if node.module else [])
            for alias in node.names:
                submodule = resolve([*base, alias.name])
                if submodule is not None:
                    out.add(submodule)
                else:
                    target = resolve(base)
                    if target is not None:
                        out.add(target)
    out.discard(".".join(rel.with_suffix("").parts))
    return out


#: What the engine package promises not to do, and where NIXL may be called from.
_NO_THREADS = ("threading", "concurrent.futures", "zmq.asyncio")


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_engine_package_starts_no_threads_sleeps_no_blocking_sleep_and_calls_nixl_in_one_module(
        path: Path) -> None:
    tree = ast.parse(path.read_text(), str(path))
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            imported.add(node.module)
    where = path.relative_to(PACKAGE)
    assert not {m for m in imported if m.split(".")[0] in ("threading",) or m.startswith(_NO_THREADS)}, \
        f"{where} imports a thread or executor module"
    assert "to_thread" not in path.read_text(), f"{where} hands work to a thread"
    sleeps = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Attribute)
              and node.attr == "sleep" and isinstance(node.value, ast.Name) and node.value.id == "time"]
    assert not sleeps, f"{where}:{sleeps[0]} sleeps blocking (time.sleep)"
    if where != Path("_nixl.py"):
        nixl = sorted(m for m in imported if m.split(".")[0] == "nixl" or m.startswith("nixl_"))
        assert not nixl, f"{where} imports {nixl}: only _nixl.py talks to NIXL"

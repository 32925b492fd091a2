"""Package boundaries, read from the import statements: the coordinator and the worker
meet only in ``shared_memory/`` (the contract), and kernels know neither."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("coordinator", "worker", "shared_memory", "kernels", "deploy")


def _imports(path: Path) -> set[str]:
    """The first-party packages a module imports (at any level, lazily or not)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
        found |= {n.split(".")[0] for n in names if n.split(".")[0] in PACKAGES}
    return found


def _graph() -> dict[str, set[str]]:
    return {p.relative_to(ROOT).as_posix(): _imports(p)
            for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def test_only_the_worker_pool_and_the_offline_engine_import_worker():
    users = {m for m, deps in _graph().items() if m.startswith("coordinator/") and "worker" in deps}
    assert users == {"coordinator/server/worker_pool.py", "coordinator/engine/llm_engine.py"}


def test_lower_layers_do_not_import_upper_ones():
    allowed = {"kernels": set(), "shared_memory": set(), "worker": {"kernels", "shared_memory"}}
    for module, deps in _graph().items():
        pkg = module.split("/")[0]
        if pkg in allowed:
            extra = deps - allowed[pkg] - {pkg}
            assert not extra, f"{module} imports {sorted(extra)}"


def _module_graph() -> dict[str, set[str]]:
    """First-party module -> the first-party modules it imports (any level, TYPE_CHECKING too)."""
    files = {p.relative_to(ROOT).with_suffix("").as_posix().replace("/", "."): p
             for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph = {}
    for mod, path in files.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            deps |= {n for n in names if n in files and n != mod}
        graph[mod.removesuffix(".__init__")] = {d.removesuffix(".__init__") for d in deps}
    return graph


def test_no_import_circle():
    graph = _module_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(mod: str, path: list[str]) -> None:
        state[mod] = 1
        for dep in sorted(graph.get(mod, ())):
            assert state.get(dep) != 1, "import circle: " + " -> ".join(path[path.index(dep):] + [dep]) \
                if dep in path else f"import circle through {dep}"
            if dep not in state:
                visit(dep, path + [dep])
        state[mod] = 2

    for mod in sorted(graph):
        if mod not in state:
            visit(mod, [mod])
    assert len(graph) > 50, "the graph holds the modules (a check that cannot fail otherwise)"


def test_the_offline_engine_and_the_gpu_tests_import_no_server_dependencies():
    """A GPU image has torch, triton and transformers but no Ray, ZeroMQ or llguidance: the
    offline engine, the GPU tests and the GPU benchmarks must import without them (llguidance
    loads with the first grammar; the socket executor is the server's)."""
    import subprocess
    import sys

    code = ("import sys\n"
            "import coordinator.engine.llm_engine, benchmarks.cuda_peers, benchmarks.cuda_profile\n"
            "import tests.test_cuda, tests.test_graphs, tests.test_quantization\n"
            "print(sorted(m for m in ('ray', 'zmq', 'llguidance') if m in sys.modules))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == "[]", run.stdout

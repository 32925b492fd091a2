"""Package boundaries, read from the import statements: the coordinator and the worker
meet only in ``shared_memory/`` (the contract); the model lives in ``worker/model/`` above the
kernels; kernels know neither, and the coordinator reads of them only the model's description."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("coordinator", "worker", "shared_memory", "kernels", "deploy")


def _local(name: str) -> str:
    """An imported name as the folders spell it (``fusedserve.kernels.x`` -> ``kernels.x``)."""
    return name.removeprefix("fusedserve.")


def _imported(node: ast.AST) -> list[str]:
    """What an import statement names, as the folders spell it: ``from a import b`` gives ``a``
    and ``a.b`` (b may be a module); ``from fusedserve import a`` gives ``a``."""
    if isinstance(node, ast.Import):
        return [_local(a.name) for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        if node.module == "fusedserve":
            return [a.name for a in node.names]
        return [_local(node.module)] + [f"{_local(node.module)}.{a.name}" for a in node.names]
    return []


def _imports(path: Path) -> set[str]:
    """The first-party packages a module imports (at any level, lazily or not)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        found |= {n.split(".")[0] for n in _imported(node) if n.split(".")[0] in PACKAGES}
    return found


def _graph() -> dict[str, set[str]]:
    return {p.relative_to(ROOT).as_posix(): _imports(p)
            for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def test_only_the_worker_pool_and_the_offline_engine_import_worker():
    users = {m for m, deps in _graph().items() if m.startswith("coordinator/") and "worker" in deps}
    assert users == {"coordinator/server/worker_pool.py", "coordinator/engine/llm_engine.py"}


def _modules(path: Path) -> set[str]:
    """The first-party modules a file imports, dotted, as written (any level, lazily or not)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = _imported(node)
        found |= set(names[1:] if isinstance(node, ast.ImportFrom) and len(names) > 1 else names)
    return {m for m in found if m.split(".")[0] in PACKAGES}


def test_the_coordinator_reads_of_the_kernels_only_the_model_description():
    """Config resolution, KV sizing and the front ends need the model's shape, its checkpoint format
    and the quantization modes, never device code (which may build the native extension)."""
    for pkg in ("coordinator", "deploy"):
        for path in (ROOT / pkg).rglob("*.py"):
            kernel_imports = {m for m in _modules(path) if m.startswith("kernels")}
            outside = {m for m in kernel_imports if not m.startswith("kernels.model_description.")}
            assert not outside, f"{path.relative_to(ROOT)} imports {sorted(outside)}"


def test_the_model_description_imports_no_device_code():
    """Nothing the description imports builds or loads a kernel: only the native build's probes
    of the host (flags, toolchain), which read files."""
    for path in (ROOT / "kernels" / "model_description").rglob("*.py"):
        for m in _modules(path):
            assert m.startswith(("kernels.model_description.", "kernels.native.build")), f"{path.name}: {m}"


def test_the_model_lives_above_the_kernels():
    """One room holds the model (config use, loader, checkpoint formats, MoE, TP, workspace): the
    worker's; the kernels below it hold no model code and no backend is spread outside its folder."""
    assert not (ROOT / "kernels" / "model").exists() and not (ROOT / "kernels" / "backends").exists()
    for name in ("qwen3", "loader", "moe", "tensor_parallel", "workspace", "gguf_tensors", "group_quant"):
        assert (ROOT / "worker" / "model" / f"{name}.py").is_file()
    for backend in ("native", "aten", "triton", "ascend"):
        assert (ROOT / "kernels" / backend / "backend.py").is_file()
    assert (ROOT / "kernels" / "native" / "csrc" / "module.cpp").is_file()


def test_lower_layers_do_not_import_upper_ones():
    # The kernels implement the contract's sampling row (shared_memory/sampling_row.py); the
    # contract itself imports nothing first-party.
    allowed = {"kernels": {"shared_memory"}, "shared_memory": set(), "worker": {"kernels", "shared_memory"}}
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
            deps |= {n for n in _imported(node) if n in files and n != mod}
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
            "import fusedserve.coordinator.engine.llm_engine\n"
            "import fusedserve.benchmarks.cuda_peers, fusedserve.benchmarks.cuda_profile\n"
            "import tests.kernels.test_cuda, tests.kernels.test_graphs, tests.model.test_quantization\n"
            "print(sorted(m for m in ('ray', 'zmq', 'llguidance') if m in sys.modules))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == "[]", run.stdout


def test_no_product_file_is_over_400_lines():
    """A file past 400 lines holds more than one job: split it by what its parts hold."""
    long = {p.relative_to(ROOT).as_posix(): n for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long

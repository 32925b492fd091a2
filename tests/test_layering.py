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

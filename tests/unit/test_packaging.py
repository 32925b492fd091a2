"""The package installs as ``fusedserve`` alone: the design's folders map onto ``fusedserve.*``, so
nothing of it shadows another distribution's top-level name (Hugging Face's ``kernels``, which
transformers imports from 5.25 on), from the project root or from site-packages."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("coordinator", "worker", "shared_memory", "kernels", "deploy", "benchmarks")


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_folder_holding_python_is_a_listed_package():
    cfg = _setuptools()
    assert cfg["package-dir"] == {f"fusedserve.{f}": f for f in FOLDERS}
    want = {"fusedserve." + ".".join(d.relative_to(ROOT).parts)
            for f in FOLDERS for d in [ROOT / f, *(ROOT / f).rglob("*")]
            if d.is_dir() and d.name != "__pycache__" and any(d.glob("*.py"))}
    assert set(cfg["packages"]) == want
    assert "fusedserve.coordinator.cli:main" in (ROOT / "pyproject.toml").read_text()


def test_transformers_imports_and_builds_a_qwen3_from_the_project_root():
    """Run where a user runs scripts: the project root first on the path."""
    code = ("import kernels, transformers, fusedserve.kernels.native.build as b\n"
            "from transformers import Qwen3Config, Qwen3ForCausalLM\n"
            "m = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64,\n"
            "    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16))\n"
            "ours = [str(p) for p in getattr(kernels, '__path__', [])]\n"
            "print(getattr(kernels, '__file__', None), ours, b.__name__)\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    file, *_ = run.stdout.split()
    # Hugging Face's kernels where it is installed (a regular package beats our folder, which has no
    # __init__.py); where it is not, the name is at most a namespace over our folder, never a module.
    assert file == "None" or "site-packages" in file, run.stdout
    assert "fusedserve.kernels.native.build" in run.stdout


def test_a_built_wheel_holds_only_fusedserve(tmp_path):
    src = tmp_path / "src"  # a copy: setuptools builds in the source tree (build/), never in ours
    for name in (*FOLDERS, "pyproject.toml", "README.md"):
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy2
        copy(ROOT / name, src / name, **({"ignore": shutil.ignore_patterns("__pycache__")}
                                         if (ROOT / name).is_dir() else {}))
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path), str(src)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    (wheel,) = tmp_path.glob("fusedserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"fusedserve", next(t for t in tops if t.endswith(".dist-info"))}, tops
    assert "fusedserve/kernels/native/csrc/module.cpp" in names
    assert "fusedserve/coordinator/model_files/default_model/model.safetensors" in names
    assert "fusedserve/kernels/native/build.py" in names and "fusedserve/coordinator/cli.py" in names

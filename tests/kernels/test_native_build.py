"""Where the native build takes its sources from: a folder named for their content, so a second
checkout (or a ``ray job`` working directory) of the same sources finds the first one's build."""

from __future__ import annotations

import shutil

import pytest

from fusedserve.kernels.native import build as native


def test_the_same_sources_at_two_paths_stage_to_one_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    a, b = tmp_path / "checkout_a" / "csrc", tmp_path / "checkout_b" / "csrc"
    shutil.copytree(native.CSRC, a)
    shutil.copytree(native.CSRC, b)
    staged = native.staged_sources(a)
    assert native.staged_sources(b) == staged and staged.parent == tmp_path / "ext"
    assert sorted(p.name for p in staged.iterdir()) == sorted(
        p.name for p in native.CSRC.iterdir() if p.suffix in (".cpp", ".h"))
    assert (staged / "kernels.h").read_bytes() == (native.CSRC / "kernels.h").read_bytes()
    (b / "norm.cpp").write_text((b / "norm.cpp").read_text() + "\n// changed\n")
    changed = native.staged_sources(b)
    assert changed != staged and "// changed" in (changed / "norm.cpp").read_text()
    assert not list((tmp_path / "ext").glob(".fusedserve_src_*")), "no half-copied folder is left"


def test_a_build_not_in_the_cache_is_reported_as_such(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "empty"))
    assert not native.is_built("scalar", name="fusedserve_never_built")


@pytest.mark.skipif(native.missing_toolchain() is not None, reason="no C++ toolchain: nothing is built")
def test_a_first_build_announces_itself_and_its_time(monkeypatch, caplog, tmp_path):
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: kw["name"])  # the compiler's part, stood in
    with caplog.at_level("WARNING", logger=native.__name__):
        assert native.build.__wrapped__("scalar", name="fusedserve_announce") == "fusedserve_announce_scalar"
    said = [r.getMessage() for r in caplog.records]
    assert said[0].startswith("building the native CPU kernels for scalar (first run on this machine only")
    assert said[1].startswith("native CPU kernels for scalar ready in ")


def test_the_kernels_are_ready_before_the_weight_bar_starts(monkeypatch):
    """A first run builds (minutes) before any weight bar is drawn, not behind one stuck at 0%."""
    from types import SimpleNamespace

    import torch

    from fusedserve.coordinator.engine import llm_engine
    from fusedserve.shared_memory.engine_config import EngineConfig

    calls = []
    monkeypatch.setattr(native, "kernels", lambda: calls.append("kernels"))
    monkeypatch.setattr(llm_engine, "weight_progress", lambda *a, **k: (
        calls.append("bar"), (lambda done, total: None, SimpleNamespace(close=lambda: None)))[1])
    monkeypatch.setattr(llm_engine.Qwen3Model, "from_pretrained", lambda *a, **k: calls.append("weights"))
    llm_engine._load(EngineConfig.build(device="cpu"), torch.device("cpu"))
    assert calls == ["kernels", "bar", "weights"]

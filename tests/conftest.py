"""Shared fixtures: small random-weight Qwen3 checkpoints written with transformers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

# Two shapes that differ in head_dim, GQA ratio and tied embeddings.
CONFIGS = {
    "gqa2_untied": dict(vocab_size=384, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                        tie_word_embeddings=False, rope_theta=10000.0),
    "gqa4_tied": dict(vocab_size=320, hidden_size=96, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                      tie_word_embeddings=True, rope_theta=1_000_000.0),
}


def write_hf_checkpoint(path: Path, name: str, seed: int = 0, shard: bool = False) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(**CONFIGS[name], max_position_embeddings=512, rms_norm_eps=1e-6)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    model.save_pretrained(path, max_shard_size="100KB" if shard else "5GB")
    return path


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {
        "gqa2_untied": write_hf_checkpoint(root / "gqa2_untied", "gqa2_untied"),
        "gqa4_tied": write_hf_checkpoint(root / "gqa4_tied", "gqa4_tied", seed=1, shard=True),
    }


@pytest.fixture(scope="session")
def moe_dir(tmp_path_factory):
    """4 layers: 8 experts, top 2, renormalised, in layers 0, 2 and 3; layer 1 dense
    (``mlp_only_layers``)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                         mlp_only_layers=[1], max_position_embeddings=256, tie_word_embeddings=False)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():  # routers with some spread, so that routing is decided, not a near tie
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.mul_(8)
    out = tmp_path_factory.mktemp("moe")
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="session", autouse=True)
def _native_kernels():
    """Build the native CPU kernels once, before any worker process would (they load the cache).
    Where a compiler is present a failed build fails every test: it is a bug, never a skip."""
    from fusedserve.kernels.native import build as native

    native.require()
    yield


@pytest.fixture(scope="session", autouse=True)
def _model_cache(tmp_path_factory):
    """Embedded default model (and the GEMM timings) written into a per-run cache, as on a fresh
    machine."""
    if "FUSEDSERVE_CACHE" not in os.environ:
        os.environ["FUSEDSERVE_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    yield


# Rooms whose every module starts Ray (a fixture's cluster or a served process's own head).
RAY_ROOMS = ("server", "http", "deploy")
# Modules that take most of the suite's time on 2 cores (measured with --durations=0): every ISA
# build of the native kernels, Ray heads of their own, jobs, network namespaces, tensor-parallel
# process groups, a 0.6B-shaped checkpoint. ``-m "not slow"`` leaves them out.
SLOW_MODULES = frozenset({
    "test_native_kernels", "test_kv_cache_int8", "test_triton_kernels",  # kernels/
    "test_tensor_parallel",  # model/
    "test_ray_cluster", "test_network_exposure", "test_multinode", "test_worker_faults",  # server/
    "test_tensor_parallel_serving",
    "test_real_use", "test_overload",  # http/
    "test_deploy", "test_cli", "test_soak",  # deploy/
})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The ``ray`` and ``slow`` markers, from where a test sits and what it uses (``gpu`` is
    written on the tests that need a device)."""
    for item in items:
        path = Path(str(item.path))
        if path.parent.name in RAY_ROOMS or "ray_session" in item.fixturenames:
            item.add_marker(pytest.mark.ray)
        if path.stem in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)


os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # local heads default to token auth: choose
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray cluster for the whole run (starting one costs seconds)."""
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()

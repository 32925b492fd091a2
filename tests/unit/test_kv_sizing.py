"""The KV cache sized from memory (coordinator/engine/kv_sizing.py), the size flag's parser and the
cores each rank is pinned to: the figures the startup lines state."""

from __future__ import annotations

import argparse
import logging

import pytest
import torch

from fusedserve.coordinator.engine import kv_sizing
from fusedserve.coordinator.model_files.default_model import default_model_dir
from fusedserve.coordinator.server.core_slots import CoreSlots, usable_cpus
from fusedserve.kernels.model_description.config import Qwen3Config
from fusedserve.shared_memory.engine_config import CacheConfig
from fusedserve.shared_memory.setting import parse_size

GIB = 1 << 30


@pytest.fixture(scope="module")
def qwen3_06b() -> Qwen3Config:
    return Qwen3Config.from_dir(default_model_dir("qwen3-0.6b"))


def _plan(c: Qwen3Config, dtype: torch.dtype = torch.bfloat16, block_size: int = 16,
          num_blocks: int | None = None, kv_memory: int | None = None, gpu_util: float = 0.9,
          **kw) -> kv_sizing.KVPlan:
    cache = CacheConfig(block_size, num_blocks, kv_memory, gpu_util)
    args = dict(device_kind="cpu", max_batch=128, max_model_len=None, weight_bytes=0, ranks_on_node=1, tp=1)
    return kv_sizing.plan(c, dtype, cache, **{**args, **kw})


def test_bytes_per_token_is_every_layers_k_and_v_on_one_rank(qwen3_06b):
    c = qwen3_06b  # 28 layers, 8 KV heads of 128
    assert kv_sizing.bytes_per_token(c, torch.bfloat16, 1) == 28 * 2 * 8 * 128 * 2 == 114_688
    assert kv_sizing.bytes_per_token(c, torch.bfloat16, 2) == 114_688 // 2
    assert kv_sizing.bytes_per_token(c, torch.float32, 16) == 28 * 2 * 1 * 128 * 4  # replicated past 8


def test_kv_cache_memory_gives_its_blocks_and_cuts_the_default_context_stated(qwen3_06b, caplog):
    with caplog.at_level(logging.WARNING, logger="fusedserve.coordinator.engine.kv_sizing"):
        p = _plan(qwen3_06b, kv_memory=GIB)
    assert p.num_blocks == GIB // (114_688 * 16) == 585 and p.max_model_len == p.tokens == 9360
    assert p.max_concurrency == 1.0 and "--kv-cache-memory" in p.describe()
    assert "40960" in caplog.text and "--kv-cache-memory" in caplog.text


def test_an_asked_context_that_does_not_fit_refuses_naming_both_figures_and_the_flags(qwen3_06b):
    with pytest.raises(ValueError) as err:
        _plan(qwen3_06b, kv_memory=GIB, max_model_len=32768)
    msg = str(err.value)
    assert "9360 tokens" in msg and "32768" in msg and "--kv-cache-memory" in msg and "--max-model-len" in msg


def test_no_more_blocks_than_max_batch_sequences_of_the_context_can_hold(qwen3_06b):
    p = _plan(qwen3_06b, kv_memory=64 * GIB, max_batch=2, max_model_len=100)
    assert p.num_blocks == 2 * 7 and p.max_model_len == 100  # ceil(100 / 16) blocks a sequence


def test_num_blocks_overrides_memory(qwen3_06b):
    p = _plan(qwen3_06b, num_blocks=40, kv_memory=GIB, max_model_len=640)
    assert (p.num_blocks, p.source, p.max_model_len) == (40, "--num-blocks", 640)


def test_the_cpu_default_is_a_share_of_available_memory_over_the_nodes_ranks(qwen3_06b, monkeypatch):
    monkeypatch.setattr(kv_sizing, "memory_left", lambda: 20 * GIB)
    p = _plan(qwen3_06b, ranks_on_node=4, max_model_len=4096)
    budget = int(kv_sizing.CPU_KV_SHARE * 20 * GIB) // 4
    assert p.num_blocks == budget // (114_688 * 16) and "4 worker ranks" in p.source


def test_memory_left_is_positive_and_below_the_machines_memory():
    total = int(open("/proc/meminfo").read().split()[1]) * 1024
    assert 0 < kv_sizing.memory_left() <= total


@pytest.mark.parametrize("text, want", [("8GiB", 8 * GIB), ("512MiB", 512 << 20), ("1.5G", 3 * GIB // 2),
                                        ("4096", 4096), ("2gb", 2 * GIB), ("64K", 64 << 10)])
def test_sizes_parse_in_powers_of_1024(text, want):
    assert parse_size(text) == want


@pytest.mark.parametrize("text", ["", "GiB", "lots", "-1G", "0"])
def test_a_bad_size_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size(text)


def test_each_rank_gets_cores_of_its_own():
    cpus = usable_cpus()
    slots = CoreSlots(ranks=len(cpus))
    taken = [slots.take() for _ in cpus]
    assert slots.threads == 1 and sorted(c for _, group in taken for c in group) == cpus
    assert slots.take() == (None, [])  # every group out: a further rank runs unpinned
    slots.give(taken[0][0])
    assert slots.take() == taken[0]
    whole = CoreSlots(ranks=1)
    assert whole.threads == len(cpus) and whole.take()[1] == cpus

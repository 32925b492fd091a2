"""Tensor parallelism in the model: N processes with gloo, each loading its share of a small
checkpoint, against the whole model in this process. Heads split and replicated, the vocabulary
padded, tied embeddings, a MoE split by experts' width and placed whole."""

from __future__ import annotations

import io
import os

import pytest
import torch
import torch.multiprocessing as mp

from fusedserve.coordinator.server.ray_cluster import free_port
from fusedserve.kernels.model_description.config import ConfigError, Qwen3Config
from fusedserve.worker.model.qwen3 import Qwen3Model
from fusedserve.worker.model.tensor_parallel import TensorParallel
from tests.model_batches import decode_batch, prompt_batch

BLOCK = 4
PROMPTS = [[5, 17, 42, 99, 3, 8, 1, 9, 30], [250, 1, 8], [77] * 11]


def _logits(model: Qwen3Model, vocab: int) -> torch.Tensor:
    """Prefill three prompts in one launch, then four decode steps of all three: [5, 3, V]."""
    kv = model.new_kv_cache(num_blocks=40, block_size=BLOCK, max_seqs=len(PROMPTS))
    ws = model.new_workspace(max_rows=8, block_size=BLOCK)
    tables = [[3, 9, 1, 12, 20], [0, 7, 30], [5, 2, 14, 33, 21]]
    out = torch.empty(len(PROMPTS), vocab)
    model.forward(prompt_batch(PROMPTS, tables, BLOCK), kv, ws, out)
    steps = [out.clone()]
    pos = [len(p) for p in PROMPTS]
    for _ in range(4):
        nxt = steps[-1].argmax(-1).tolist()
        model.forward(decode_batch([(t, p, tb) for t, p, tb in zip(nxt, pos, tables)], BLOCK), kv, ws, out)
        steps.append(out.clone())
        pos = [p + 1 for p in pos]
    return torch.stack(steps)


def _pooled(model: Qwen3Model, vocab: int) -> torch.Tensor:
    """The three prompts in one launch, as a pooling runner reads them: each one's last token's
    final-normed hidden state, and a yes/no score (tokens 7 and 5) over the vocab-parallel lm_head."""
    kv = model.new_kv_cache(num_blocks=40, block_size=BLOCK, max_seqs=len(PROMPTS))
    ws = model.new_workspace(max_rows=8, block_size=BLOCK)
    batch = prompt_batch(PROMPTS, [[3, 9, 1, 12, 20], [0, 7, 30], [5, 2, 14, 33, 21]], BLOCK)
    x = model.forward(batch, kv, ws, None)
    last = batch.query_start_loc[1:] - 1
    hidden, score = torch.empty(len(PROMPTS), model.config.hidden_size), torch.empty(len(PROMPTS), 1)
    logits = torch.empty(len(PROMPTS), vocab)
    model.pool(x, last, hidden, ws, logits)
    model.pool(x, last, score, ws, logits, (7, 5))
    return torch.cat([hidden, score], 1)


def _rank(rank: int, size: int, port: int, path: str, dtype: str, ep: bool, quant, result,
          what: str = "logits") -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        tp = TensorParallel(rank, size, expert_parallel=ep)
        model = Qwen3Model.from_pretrained(path, dtype=dtype, quantization=quant, tp=tp)
        buf = io.BytesIO()  # bytes, not a shared tensor: this process exits next
        torch.save((_pooled if what == "pooled" else _logits)(model, model.config.vocab_size), buf)
        result.put((rank, buf.getvalue()))
    finally:
        dist.destroy_process_group()


def run_ranks(path, size: int, dtype: str = "float32", ep: bool = False, quant=None,
              what: str = "logits") -> list[torch.Tensor]:
    """Every rank's logits (or ``what="pooled"``: pooled rows), in rank order."""
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, size, port, str(path), dtype, ep, quant, result, what))
             for r in range(size)]
    for p in procs:
        p.start()
    got = dict(result.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    return [torch.load(io.BytesIO(got[r])) for r in range(size)]


@pytest.fixture(scope="module")
def odd_vocab(tmp_path_factory):
    """A vocabulary no group size divides (333), untied: the last vocab shard is padded."""
    from transformers import Qwen3Config as HFConfig
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(3)
    cfg = HFConfig(vocab_size=333, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=4, head_dim=16, tie_word_embeddings=False,
                   max_position_embeddings=256)
    model = Qwen3ForCausalLM(cfg)
    out = tmp_path_factory.mktemp("odd_vocab")
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize("name,size", [("gqa2_untied", 2), ("gqa4_tied", 2), ("gqa4_tied", 4)],
                         ids=["gqa2-tp2-kv-split", "gqa4-tied-tp2", "gqa4-tied-tp4-kv-replicated"])
def test_fp32_logits_equal_the_whole_model(hf_checkpoints, name, size):
    path = hf_checkpoints[name]
    want = _logits(Qwen3Model.from_pretrained(path, dtype="float32"), Qwen3Config.from_dir(path).vocab_size)
    ranks = run_ranks(path, size)
    for got in ranks:  # every rank holds the whole logits, the same to the bit
        assert torch.equal(got, ranks[0])
    torch.testing.assert_close(ranks[0], want, atol=1e-4, rtol=1e-4)
    assert torch.equal(ranks[0].argmax(-1), want.argmax(-1))


def test_pooled_rows_equal_the_whole_model(hf_checkpoints):
    """A pooling runner under tensor parallelism: every rank pools the same rows as one device."""
    path = hf_checkpoints["gqa2_untied"]
    want = _pooled(Qwen3Model.from_pretrained(path, dtype="float32"), Qwen3Config.from_dir(path).vocab_size)
    ranks = run_ranks(path, 2, what="pooled")
    assert torch.equal(ranks[0], ranks[1])
    torch.testing.assert_close(ranks[0], want, atol=1e-4, rtol=1e-4)


def test_padded_vocab_shard(odd_vocab):
    want = _logits(Qwen3Model.from_pretrained(odd_vocab, dtype="float32"), 333)
    got = run_ranks(odd_vocab, 2)[0]
    assert got.shape[-1] == 333
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_bf16_stays_as_close_to_fp32_as_one_rank(hf_checkpoints):
    path = hf_checkpoints["gqa2_untied"]
    ref = _logits(Qwen3Model.from_pretrained(path, dtype="float32"), 384)
    one = _logits(Qwen3Model.from_pretrained(path, dtype="bfloat16"), 384)
    two = run_ranks(path, 2, dtype="bfloat16")[0]
    err_one, err_two = (one - ref).abs().max().item(), (two - ref).abs().max().item()
    assert err_two <= 2 * err_one + 1e-2, (err_one, err_two)


def test_a_model_the_group_cannot_split_is_refused(hf_checkpoints):
    c = Qwen3Config.from_dir(hf_checkpoints["gqa4_tied"])  # 8 heads, 2 KV heads, MLP 128
    with pytest.raises(ConfigError, match="num_attention_heads"):
        TensorParallel(0, 3).check(c)
    assert TensorParallel(0, 4).kv_heads(c) == range(0, 1) and TensorParallel(3, 4).kv_heads(c) == range(1, 2)


@pytest.mark.parametrize("ep", [False, True], ids=["experts-split", "experts-placed-whole"])
def test_moe_logits_equal_the_whole_model(moe_dir, ep):
    want = _logits(Qwen3Model.from_pretrained(moe_dir, dtype="float32"), 320)
    got = run_ranks(moe_dir, 2, ep=ep)[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_int8_ranks_stay_as_close_to_fp32_as_one_rank(hf_checkpoints):
    """W8A8: a row-parallel projection quantizes each rank's half of its input with that half's own
    per-token scale, so the group's rounding differs from one rank's, but not its size."""
    path = hf_checkpoints["gqa2_untied"]
    ref = _logits(Qwen3Model.from_pretrained(path, dtype="float32"), 384)[0]  # the prefill's logits
    one = _logits(Qwen3Model.from_pretrained(path, dtype="bfloat16", quantization="int8"), 384)[0]
    two = run_ranks(path, 2, dtype="bfloat16", quant="int8")[0][0]
    err_one, err_two = (one - ref).abs().max().item(), (two - ref).abs().max().item()
    assert err_two <= 2 * err_one, (err_one, err_two)


def _shm_rank(rank: int, size: int, path: str, leaves: bool, result) -> None:
    """Rank ``rank`` of a ShmComm group with 256-byte slots, so tensors go in pieces. ``leaves``:
    the last rank maps the file and exits before the first collective; the others' ``alive()``
    turns False once it has."""
    from fusedserve.kernels.native import build as native
    from fusedserve.kernels.native.shm_comm import ShmComm

    torch.set_num_threads(1)
    marker = f"{path}.rank{size - 1}"
    alive = (lambda: os.path.exists(marker)) if leaves else (lambda: True)
    comm = ShmComm(path, rank, size, native.kernels(), alive, slot_bytes=256)
    if leaves and rank == size - 1:
        os.unlink(marker)
        return
    gen = torch.Generator().manual_seed(rank)
    out: dict = {}
    try:
        for dtype in (torch.float32, torch.bfloat16):
            t = torch.randn(7, 50, generator=gen).to(dtype)  # 1400 / 700 bytes: several pieces each
            mine = t.clone()
            comm.all_reduce(t)
            parts = [torch.empty(3, 41, dtype=dtype) for _ in range(size)]
            comm.all_gather(parts, mine[:3, :41].contiguous())
            out[dtype] = (mine, t, parts)
    except RuntimeError as exc:
        out["error"] = type(exc).__name__
    buf = io.BytesIO()  # bytes, not shared tensors: this process exits at once
    torch.save(out, buf)
    result.put((rank, buf.getvalue()))


def _shm_group(tmp_path, size: int, leaves: bool) -> dict[int, dict]:
    from fusedserve.kernels.native import build as native
    from fusedserve.kernels.native.shm_comm import ShmComm

    if native.require() is None:
        pytest.skip("the shared-memory collectives run on the native build")
    path = str(tmp_path / "tp-shm")
    ShmComm(path, 0, size, native.kernels(), lambda: True, slot_bytes=256, create=True)
    open(f"{path}.rank{size - 1}", "w").close()
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    procs = [ctx.Process(target=_shm_rank, args=(r, size, path, leaves, result)) for r in range(size)]
    for p in procs:
        p.start()
    got = dict(result.get(timeout=120) for _ in range(size - leaves))
    for p in procs:
        p.join(timeout=30)
    return {r: torch.load(io.BytesIO(raw)) for r, raw in got.items()}


def test_shm_collectives_sum_in_rank_order_and_gather(tmp_path):
    got = _shm_group(tmp_path, 3, leaves=False)
    for dtype in (torch.float32, torch.bfloat16):
        mines = [got[r][dtype][0] for r in range(3)]
        want = torch.add(mines[0], mines[1]).add_(mines[2])  # rank order, in the dtype
        for r in range(3):
            _, summed, parts = got[r][dtype]
            assert torch.equal(summed, want), (r, dtype)  # every rank holds the same bits
            for j in range(3):
                assert torch.equal(parts[j], mines[j][:3, :41]), (r, j, dtype)


def test_shm_collective_with_a_peer_gone_raises(tmp_path):
    got = _shm_group(tmp_path, 2, leaves=True)
    assert got[0] == {"error": "PeerGone"}

"""Hands out a worker's KV blocks to sequences, and keeps full blocks as a prefix cache.

A sequence's token ``p`` is in slot ``table[p // block_size] * block_size + p % block_size``
of the device cache (kernels/kv_cache.py); blocks need not be contiguous or ordered.

Prefix caching (vLLM's scheme): a full block is named by a chained hash of every token up
to its end (sha256 of the parent block's hash and its own token ids), so equal hashes mean
equal K/V. Blocks are shared by reference count; a hashed block nobody holds stays cached,
evicted least recently used first when a fresh block is needed. A new sequence reuses the
longest cached run of its prompt's full blocks, and prefill computes only the rest.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np


class OutOfBlocks(RuntimeError):
    """The cache has too few free blocks for a request right now."""


@dataclass
class PrefixCacheStats:
    queries: int = 0  # sequences that looked up their prompt
    hits: int = 0  # ... that reused at least one block
    query_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # ... whose K/V came from the cache
    evictions: int = 0  # cached blocks reclaimed for new ones


def block_hash(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.sha256(parent + np.asarray(tokens, dtype=np.int64).tobytes()).digest()


def prefix_hashes(token_ids: list[int], block_size: int, root: bytes = b"") -> list[bytes]:
    """The chained hashes of ``token_ids``' full blocks that a cache hit may cover: all but the
    last token (its logits give the next one). ``root``: the first block's parent (b"" for the base
    model; a LoRA adapter's own, so its blocks never serve another's requests)."""
    arr = np.asarray(token_ids, dtype=np.int64)  # once: each block's slice is a view of it
    out, parent = [], root
    for i in range((len(token_ids) - 1) // block_size):
        parent = block_hash(parent, arr[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out


@dataclass
class BlockManager:
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)

    def __post_init__(self) -> None:
        self._free: list[int] = list(range(self.num_blocks - 1, -1, -1))  # never hashed
        self._refs = [0] * self.num_blocks
        self._hash: dict[int, bytes] = {}  # block -> its chained hash (full, computed blocks)
        self._cached: dict[bytes, int] = {}  # hash -> block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # hashed, unreferenced: LRU first
        self._tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[bytes]] = {}  # a sequence's hashed blocks, in order
        self._roots: dict[str, bytes] = {}  # a sequence's first parent hash, where not b"" (LoRA)

    # ------------------------------------------------------------------- counts

    @property
    def num_free(self) -> int:
        """Blocks a new allocation may take: never used, or cached and unreferenced."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks kept for their content (counted in ``num_free`` too)."""
        return len(self._evictable)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --------------------------------------------------------------- allocation

    def cached_prefix(self, token_ids: list[int], hashes: list[bytes] | None = None) -> list[int]:
        """The cached blocks holding the longest run of ``token_ids``' full blocks, leaving at
        least one token to compute (its logits give the next token). ``hashes``: their
        ``prefix_hashes``, where the caller has them already."""
        if not self.enable_prefix_caching:
            return []
        hashes = prefix_hashes(token_ids, self.block_size) if hashes is None else hashes
        return [self._cached[h] for h in hashes[: self.cached_run(hashes)]]

    def cached_run(self, hashes: list[bytes]) -> int:
        """How many of ``hashes`` (a prompt's ``prefix_hashes``), from the first, name blocks this
        cache holds, in use or not: what a request routed here would not compute. No side effects."""
        if not self.enable_prefix_caching:
            return 0
        n = 0
        for h in hashes:
            if h not in self._cached:
                break
            n += 1
        return n

    def allocate(self, seq_id: str, token_ids: list[int], reserve: int = 0,
                 hit: list[int] | None = None, root: bytes = b"") -> int:
        """Give ``seq_id`` blocks for ``token_ids`` (+ ``reserve`` tokens of room), reusing the
        cached prefix (``hit``: ``cached_prefix(token_ids)`` when the caller already has it);
        returns how many leading tokens are already computed. Raises OutOfBlocks, changing
        nothing, if the rest does not fit. ``root``: its hashes' first parent (``prefix_hashes``)."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already has blocks")
        if hit is None:
            hit = self.cached_prefix(token_ids, prefix_hashes(token_ids, self.block_size, root))
        need = self.blocks_for(len(token_ids) + reserve) - len(hit)
        available = self.num_free - sum(1 for b in hit if b in self._evictable)
        if need > available:
            raise OutOfBlocks(f"sequence {seq_id!r} needs {need} blocks, {available} free")
        for b in hit:
            self._take(b)
        fresh = [self._fresh() for _ in range(self.blocks_for(len(token_ids)) - len(hit))]
        self._tables[seq_id] = hit + fresh
        self._hashes[seq_id] = [self._hash[b] for b in hit]
        if root:
            self._roots[seq_id] = root
        if self.enable_prefix_caching:
            self.stats.queries += 1
            self.stats.query_tokens += len(token_ids)
            self.stats.hits += bool(hit)
            self.stats.hit_tokens += len(hit) * self.block_size
        return len(hit) * self.block_size

    def ensure(self, seq_id: str, num_tokens: int) -> None:
        """Grow ``seq_id``'s table to hold ``num_tokens`` tokens; raises OutOfBlocks."""
        table = self._tables[seq_id]
        need = self.blocks_for(num_tokens) - len(table)
        if need > self.num_free:
            raise OutOfBlocks(f"sequence {seq_id!r} needs {need} more blocks, {self.num_free} free")
        for _ in range(need):
            table.append(self._fresh())

    def trim(self, seq_id: str, num_tokens: int) -> None:
        """Give back the table's blocks past ``num_tokens`` tokens (a speculating sequence's rejected
        proposals' blocks): never named, so they are plain free blocks again."""
        table = self._tables[seq_id]
        for _ in range(len(table) - max(self.blocks_for(num_tokens), self.committed(seq_id))):
            block = table.pop()
            self._refs[block] -= 1
            if not self._refs[block]:
                self._free.append(block)

    def needs_commit(self, seq_id: str, num_computed: int) -> bool:
        """Whether ``commit`` would name a new block (cheap: a block boundary was crossed)."""
        hashes = self._hashes.get(seq_id)
        return (self.enable_prefix_caching and hashes is not None
                and len(hashes) < min(num_computed // self.block_size, len(self._tables[seq_id])))

    def commit(self, seq_id: str, token_ids: list[int], num_computed: int) -> None:
        """Name (hash) the sequence's full blocks whose K/V are computed: the first
        ``num_computed`` tokens of ``token_ids``. Later requests can then reuse them."""
        if not self.enable_prefix_caching or seq_id not in self._tables:
            return
        table, hashes = self._tables[seq_id], self._hashes[seq_id]
        bs = self.block_size
        for i in range(len(hashes), min(num_computed // bs, len(table))):
            parent = hashes[-1] if hashes else self._roots.get(seq_id, b"")
            h = block_hash(parent, token_ids[i * bs : (i + 1) * bs])
            hashes.append(h)
            block = table[i]
            if h in self._cached or block in self._hash:
                continue  # the same content is cached in another block already
            self._hash[block] = h
            self._cached[h] = block

    def committed(self, seq_id: str) -> int:
        """How many of the sequence's leading blocks are named (computed and reusable)."""
        return len(self._hashes.get(seq_id, ()))

    def hashes(self, seq_id: str) -> list[bytes]:
        """The hashes of the sequence's named blocks, in order."""
        return self._hashes.get(seq_id, [])

    def table(self, seq_id: str) -> list[int]:
        return self._tables[seq_id]

    def free(self, seq_id: str) -> None:
        """Release a sequence's blocks; hashed ones stay cached. Unknown ids are a no-op."""
        self._hashes.pop(seq_id, None)
        self._roots.pop(seq_id, None)
        for block in reversed(self._tables.pop(seq_id, [])):
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            if block in self._hash:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def flush(self) -> int:
        """Forget every unreferenced cached block (they become plain free blocks)."""
        n = len(self._evictable)
        for block in list(self._evictable):
            self._forget(block)
            self._free.append(block)
        self._evictable.clear()
        return n

    def slot(self, seq_id: str, position: int) -> int:
        table = self._tables[seq_id]
        return table[position // self.block_size] * self.block_size + position % self.block_size

    # ---------------------------------------------------------------- internals

    def _take(self, block: int) -> None:
        self._evictable.pop(block, None)
        self._refs[block] += 1

    def _fresh(self) -> int:
        """A block with no content worth keeping: a never-hashed one, else the LRU cached one."""
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            self._forget(block)
            self.stats.evictions += 1
        self._refs[block] = 1
        return block

    def _forget(self, block: int) -> None:
        h = self._hash.pop(block, None)
        if h is not None and self._cached.get(h) == block:
            del self._cached[h]

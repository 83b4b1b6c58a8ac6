"""One budget of device memory shared by KV blocks and adapter rows, traded a chunk at a time (torch-free).

Layout, the same in every layer: an arena of ``num_chunks * chunk_blocks`` KV blocks, stored as a K range
then a V range of ``block_elems`` elements per block (the runner's [2, blocks, block_size, kv_heads,
head_dim] tensor). Chunk u is KV blocks [u*c, (u+1)*c): the same element span of both ranges. A chunk is

- FREE;
- KV: its blocks belong to the block manager (free or not);
- ROWS(w): it holds adapter rows of width w. Row j of width w is elements [j*w, (j+1)*w) of the flat
  arena; a chunk holds the rows lying wholly inside one of its two spans. Rows of one width share one
  row space whatever module they serve, and a row id means the same place in every layer.

Who gets memory. KV takes a FREE chunk (lowest first) when it has no free block left. Adapter rows take
free rows of their width, then a FREE chunk (highest first, so KV and adapters meet in the middle), then a
KV chunk whose blocks are all free (its prefix cache is dropped), but never the ``kv_reserve_chunks`` the
scheduler keeps for queued sequences whose adapters are ready (loads must not take the room that the
requests they serve need). When that is not enough, KV asks the
adapter side to evict idle adapters (``adapter_reclaimer``: it never evicts one that a queued or running
request needs, nor a pinned one), and the adapter side evicts its own idle adapters (lora_tiers) or waits.
A chunk returns to FREE when its last row or its last KV block is given back; a chunk holding one live row
stays typed (row fragmentation, reported by ``stats``; there is no compaction).
"""

from __future__ import annotations

from collections.abc import Iterable

from loraplane.engine.memory.arbiter import FREE, KV, AdapterReclaimer, KVSide


class UnifiedMemory:
    reserves_kv = True  # adapter rows may take KV's chunks: the scheduler keeps queued sequences' room

    def __init__(self, num_chunks: int, chunk_blocks: int, block_elems: int, widths: Iterable[int],
                 block_bytes: int = 0) -> None:  # fmt: skip
        if num_chunks <= 0:
            raise ValueError(f"num_chunks: must be > 0, got {num_chunks}")
        if chunk_blocks <= 0 or block_elems <= 0:
            raise ValueError(f"chunk_blocks and block_elems must be > 0, got {chunk_blocks}, {block_elems}")
        self.num_chunks, self.chunk_blocks, self.block_elems = num_chunks, chunk_blocks, block_elems
        self.num_blocks = num_chunks * chunk_blocks
        self.block_bytes = block_bytes  # one KV block (K and V, every layer): the unit of the stats
        self.span = chunk_blocks * block_elems  # elements of one chunk in one range
        self.range_elems = self.num_blocks * block_elems
        self.widths = tuple(sorted(set(widths)))
        if any(w <= 0 or w > self.span for w in self.widths):
            raise ValueError(f"widths: each must be in [1, {self.span}] (a chunk's span), got {self.widths}")
        self.kind = [FREE] * num_chunks
        self._free_chunks = set(range(num_chunks))
        self._rows_free: dict[int, list[int]] = {}  # typed chunk -> its free rows
        self._rows_total: dict[int, int] = {}  # typed chunk -> its row count
        self._by_width: dict[int, set[int]] = {w: set() for w in self.widths}  # typed chunks with free rows
        self._min_rows = {
            w: min(self.rows_in(u, w).__len__() for u in range(num_chunks)) for w in self.widths
        }
        self._kv: KVSide | None = None  # the block manager, once it attached
        # Set by the scheduler each step: chunks adapter loads leave to KV (queued sequences will need them).
        self.kv_reserve_chunks = 0
        # The adapter side's (attach_adapters): evict idle adapters (none in `keep`) until `n` chunks are FREE.
        self.adapter_reclaimer: AdapterReclaimer | None = None

    # -- the two sides join -----------------------------------------------------------------------------------
    def attach_kv(self, kv: KVSide) -> None:
        self._kv = kv

    def attach_adapters(self, reclaim: AdapterReclaimer) -> None:
        self.adapter_reclaimer = reclaim

    def kv_idle(self) -> int:
        """KV chunks the block manager could give back (none of their blocks held)."""
        return self._kv.idle_kv_chunks() if self._kv is not None else 0

    def kv_release(self, count: int) -> int:
        """Have the block manager give back up to ``count`` idle KV chunks; how many it gave."""
        return self._kv.release_idle_kv_chunks(count) if self._kv is not None else 0

    # -- geometry -------------------------------------------------------------------------------------------
    def rows_in(self, chunk: int, width: int) -> list[int]:
        """Row ids of width ``width`` lying wholly inside ``chunk`` (either of its two spans)."""
        rows: list[int] = []
        for base in (0, self.range_elems):
            start = base + chunk * self.span
            rows.extend(range(-(-start // width), (start + self.span) // width))
        return rows

    def chunk_of_row(self, width: int, row: int) -> int:
        return (row * width % self.range_elems) // self.span

    def blocks_of(self, chunk: int) -> range:
        return range(chunk * self.chunk_blocks, (chunk + 1) * self.chunk_blocks)

    @property
    def num_free_chunks(self) -> int:
        return len(self._free_chunks)

    # -- KV side --------------------------------------------------------------------------------------------
    def take_kv_chunk(self) -> range | None:
        """A FREE chunk becomes KV; returns its block ids (None when no chunk is FREE)."""
        if not self._free_chunks:
            return None
        chunk = min(self._free_chunks)
        self._free_chunks.remove(chunk)
        self.kind[chunk] = KV
        return self.blocks_of(chunk)

    def give_kv_chunk(self, chunk: int) -> None:
        """The block manager gives back a KV chunk none of whose blocks it holds any more."""
        if self.kind[chunk] != KV:
            raise ValueError(f"chunk {chunk} is not a KV chunk")
        self.kind[chunk] = FREE
        self._free_chunks.add(chunk)

    def reclaim_for_kv(self, num_chunks: int, keep: frozenset = frozenset()) -> None:
        """KV needs ``num_chunks`` FREE chunks: have the adapter side evict idle adapters (none in ``keep``)."""
        if self.num_free_chunks < num_chunks and self.adapter_reclaimer is not None:
            self.adapter_reclaimer(num_chunks, keep)

    # -- adapter side ---------------------------------------------------------------------------------------
    def free_rows(self, width: int) -> int:
        return sum(len(self._rows_free[u]) for u in self._by_width[width])

    def available_rows(self, width: int) -> int:
        """Rows of ``width`` that could be taken now without evicting anything (a lower bound)."""
        return self.free_rows(width) + (self.num_free_chunks + self.kv_idle()) * self._min_rows[width]

    def fits(self, needs: dict[int, int], released: dict[int, list[int]] | None = None) -> bool:
        """Whether rows ``needs`` {width: count} could be taken now (using FREE chunks and idle KV chunks),
        once the rows ``released`` {width: row ids} were given back."""
        plan = self.plan()
        for width, rows in (released or {}).items():
            plan.release(width, rows)
        return plan.fits(needs)

    def plan(self) -> _Plan:
        """A what-if copy of the row accounting: release rows into it, then ask what fits."""
        return _Plan(self)

    def take_rows(self, width: int, count: int) -> list[int] | None:
        """``count`` rows of ``width`` (None, nothing taken, when they cannot be had without evicting)."""
        typed: list[int] = []
        while self.free_rows(width) < count:
            chunk = self._take_chunk_for_rows()
            if chunk is None:
                for u in typed:  # undo: those chunks were all free
                    self._untype(u)
                return None
            self._type(chunk, width)
            typed.append(chunk)
        rows: list[int] = []
        while len(rows) < count:  # fullest chunk first: keeps the others whole, ready to go back
            chunk = min(self._by_width[width], key=lambda u: (len(self._rows_free[u]), u))
            free = self._rows_free[chunk]
            while free and len(rows) < count:
                rows.append(free.pop())
            if not free:
                self._by_width[width].discard(chunk)
        return rows

    def give_rows(self, width: int, rows: Iterable[int]) -> None:
        for row in rows:
            chunk = self.chunk_of_row(width, row)
            if self.kind[chunk] != width:
                raise ValueError(f"row {row} of width {width} is not in a chunk of that width")
            self._rows_free[chunk].append(row)
            self._by_width[width].add(chunk)
            if len(self._rows_free[chunk]) == self._rows_total[chunk]:
                self._untype(chunk)

    def _take_chunk_for_rows(self) -> int | None:
        if not self._free_chunks and self.kv_release(1) == 0:
            return None
        chunk = max(self._free_chunks)
        self._free_chunks.remove(chunk)
        return chunk

    def _type(self, chunk: int, width: int) -> None:
        rows = self.rows_in(chunk, width)
        self.kind[chunk] = width
        self._rows_free[chunk] = rows[::-1]  # popped from the end: lowest row first
        self._rows_total[chunk] = len(rows)
        self._by_width[width].add(chunk)

    def _untype(self, chunk: int) -> None:
        self._by_width[self.kind[chunk]].discard(chunk)
        del self._rows_free[chunk], self._rows_total[chunk]
        self.kind[chunk] = FREE
        self._free_chunks.add(chunk)

    # -- accounting -----------------------------------------------------------------------------------------
    def stats(self, kv_used_blocks: int | None = None) -> dict[str, float]:
        """Chunks and bytes as KV, as adapter rows and free; ``row_fragmentation``: the share of adapter
        chunks' row bytes that are free rows (held only because a live row shares their chunk)."""
        kv = sum(1 for k in self.kind if k == KV)
        rows_chunks = [u for u, k in enumerate(self.kind) if k > 0]
        chunk_bytes = self.chunk_blocks * self.block_bytes
        elem_bytes = self.block_bytes / (2 * self.block_elems) if self.block_elems else 0.0
        used_row_bytes = free_row_bytes = 0.0
        for u in rows_chunks:
            free, total, width = len(self._rows_free[u]), self._rows_total[u], self.kind[u]
            used_row_bytes += (total - free) * width * elem_bytes
            free_row_bytes += free * width * elem_bytes
        out = {
            "chunks": self.num_chunks,
            "chunk_blocks": self.chunk_blocks,
            "kv_chunks": kv,
            "adapter_chunks": len(rows_chunks),
            "free_chunks": self.num_free_chunks,
            "bytes_kv": kv * chunk_bytes,
            "bytes_adapters": len(rows_chunks) * chunk_bytes,
            "bytes_free": self.num_free_chunks * chunk_bytes,
            "adapter_row_bytes_used": used_row_bytes,
            "row_fragmentation": free_row_bytes / max(1.0, used_row_bytes + free_row_bytes),
        }
        if kv_used_blocks is not None:
            out["kv_blocks_used"] = kv_used_blocks
        return out


class _Plan:
    """Free rows per typed chunk, rows in partly used chunks per width, and chunks any width could use."""

    def __init__(self, memory: UnifiedMemory) -> None:
        self.memory = memory
        self.free = {u: len(rows) for u, rows in memory._rows_free.items()}
        self.avail = dict.fromkeys(memory.widths, 0)
        for u, n in self.free.items():
            self.avail[memory.kind[u]] += n
        self.spare = memory.num_free_chunks + memory.kv_idle() - memory.kv_reserve_chunks

    def release(self, width: int, rows: Iterable[int]) -> None:
        for row in rows:
            self.release_in(width, self.memory.chunk_of_row(width, row), 1)

    def release_in(self, width: int, chunk: int, count: int) -> None:
        """``count`` rows of ``width`` in ``chunk`` would be given back."""
        total = self.memory._rows_total[chunk]
        self.free[chunk] += count
        self.avail[width] += count
        if self.free[chunk] == total:  # wholly free: a chunk for any width
            self.avail[width] -= total
            self.spare += 1

    def fits(self, needs: dict[int, int]) -> bool:
        chunks = 0
        for width, n in needs.items():
            short = n - self.avail[width]
            if short > 0:
                per = self.memory._min_rows[width]
                chunks += -(-short // per) if per else 1 << 30
        return chunks == 0 or chunks <= self.spare  # rows of partly used chunks take no chunk

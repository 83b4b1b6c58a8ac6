"""Launch heuristics for the Triton shrink and expand kernels (triton_ops.py): tile sizes and grid bounds.

Plain Python over the batch metadata; nothing here launches or compiles a kernel.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from loraplane.kernels.metadata import LoRABatchMeta

__all__ = [
    "DECODE_TABLE",
    "CapturePolicy",
    "LaunchConfig",
    "align_hint",
    "capture_policy",
    "pick_config",
    "set_capture_policy",
    "slice_geometry",
]


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """Tile sizes and grid bounds; ``pick_config`` derives one per (meta, module, call).

    ``block_r``: rank rows per chunk in expand (ranks above it loop, re-touching y); ``shrink_block_r``:
    the same in shrink (all slices side by side). ``n_chunk``: columns of one slice that one expand
    program covers (a slice whose width it does not divide gets a shorter, masked last chunk). ``fused``: expand computes v itself (no shrink launch; A is re-read once per
    column chunk, so only for tiny batches). ``one_launch``: shrink and expand in one launch, the
    expand by the shrink's programs once their tile's split-K planes are complete (triton_fused.py).
    ``decode``: the decode-shaped kernels (triton_decode.py): shrink programs of ``block_k`` input columns
    each (one v plane apiece; ``split_k`` unused), expand programs of ``block_n`` columns (``n_chunk``
    unused), no loop over either; ``decode_dot``: tiles of several tokens take ``tl.dot`` (else a token at a
    time). ``store``: the expand writes the delta instead of adding it (y's contents are ignored): the
    caller's base GEMM adds itself on top afterwards (``ops.lora_apply(..., store=True)``); general
    kernels only. ``pdl``: decode launches go out with programmatic dependent launch (Hopper and later):
    a program reads its tile's metadata while the kernel before it drains, and waits for it
    (``griddepcontrol.wait``) before touching x, v or y.
    """

    block_r: int = 16
    shrink_block_r: int = 16
    block_k: int = 128
    block_n: int = 128
    n_chunk: int = 1024
    split_k: int = 1
    fused: bool = False
    one_launch: bool = False
    decode: bool = False
    decode_dot: bool = True
    store: bool = False
    pdl: bool = False
    shrink_programs: int = 1024  # upper bound on grid dim 0 x split for shrink
    expand_programs: int = 16384  # upper bound on grid dim 0 x dim 1 for expand
    tile_programs: int = 0  # upper bound on grid dim 0 (programs walk tiles g, g + G, ...); 0: none
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_r", "shrink_block_r", "block_k", "block_n", "n_chunk", "split_k"):
            v = getattr(self, name)
            if v <= 0 or v & (v - 1):
                raise ValueError(f"LaunchConfig.{name} must be a power of two, got {v}")
        if min(self.block_r, self.shrink_block_r, self.block_n, self.block_k) < 16:
            raise ValueError("LaunchConfig block sizes must be >= 16 (tl.dot's minimum)")
        if self.n_chunk < self.block_n:
            raise ValueError(f"LaunchConfig.n_chunk ({self.n_chunk}) must be >= block_n ({self.block_n})")
        if self.store and (self.decode or self.one_launch):
            raise ValueError("LaunchConfig.store is for the general expand (not decode or one_launch)")
        if self.pdl and not self.decode:
            raise ValueError("LaunchConfig.pdl is for the decode kernels")


@dataclass(frozen=True, slots=True)
class CapturePolicy:
    """Launch shape of captured (CUDA-graph decode) launches, whose grid is fixed before any step is seen:
    the buffers hold ``capacity`` tile slots, but a step of one adapter fills a few of them.

    ``tile_programs``: grid dim 0 (each program walks tile slots g, g + G, ...); 0: one per slot.
    ``n_chunk``: expand columns per program (power of two); 0: the occupancy rule over all slots.
    ``k_per_program``: shrink's split-K target, columns of A per program; 0: the occupancy rule.
    ``table``: shapes listed in ``DECODE_TABLE`` take its measured launch fields (under the fields above).
    ``fused``: one launch per projection (``triton_fused``: split-K shrink, then expand by the same
    programs once their tile's shrink is complete) instead of a shrink and an expand launch.
    ``overlap``: where the caller passes its base GEMM (``lora_apply(..., base=)``), the shrink runs on a
    side stream beside it (``overlap.py``) instead of after it. ``expand_beside`` (with ``overlap``): where
    x's width times the launch's output columns (the base weight's elements when the launch covers the
    whole projection, as the engine's pooled q,k,v and gate,up launches and o and down do) is at least
    this, the expand follows the shrink there, into a zeroed delta buffer added to the GEMM's output after
    the join (``overlap.lora_beside``); 0: never, 1: always. It pays where the GEMM is longer than the LoRA
    pair (gate_up, down) and costs an add where it is not.
    ``decode`` (on by default): the decode-shaped kernels (``triton_decode``), with ``decode_k`` input
    columns per shrink program and ``decode_n`` output columns per expand program (powers of two, >= 16;
    no wider than the widest slice), ``decode_warps`` warps a program; off, ``table`` and the fields above
    shape the general kernels; ``decode_dot``: tiles of several tokens of one adapter take ``tl.dot``
    (else the one-token path, a token at a time); ``fused`` wins. ``pdl``: the decode kernels go out with
    programmatic dependent launch where the GPU has it (compute capability 9.0 and later): inside the graph
    each one starts while its predecessor drains, its programs read their tile's metadata, then wait for
    the predecessor's writes before reading x, v or y.
    """

    tile_programs: int = 0
    n_chunk: int = 0
    k_per_program: int = 0
    table: bool = True
    fused: bool = False
    overlap: bool = True
    expand_beside: int = 0
    decode: bool = True
    decode_k: int = 512
    # 1024 columns at 4 warps: each thread holds a whole rank column of its 8 outputs, so the expand sums
    # over the rank inside a thread. Narrower blocks at 4 warps split the rank across threads and reduce
    # through shared memory with bank conflicts (Nsight Compute, gate_up at 256 columns: 91% of its shared
    # wavefronts excessive, 25% of DRAM bandwidth; at 1024: 74%).
    decode_n: int = 1024
    decode_dot: bool = True
    decode_warps: int = 4
    pdl: bool = False

    def __post_init__(self) -> None:
        for name in ("decode_k", "decode_n"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 16 or v & (v - 1):
                raise ValueError(f"CapturePolicy.{name} must be a power of two >= 16, got {v!r}")
        w = self.decode_warps
        if not isinstance(w, int) or w not in (1, 2, 4, 8, 16):
            raise ValueError(f"CapturePolicy.decode_warps must be 1, 2, 4, 8 or 16, got {w!r}")
        for name in ("table", "fused", "overlap", "decode", "decode_dot", "pdl"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"CapturePolicy.{name} must be a bool, got {getattr(self, name)!r}")
        if type(self.expand_beside) is not int or self.expand_beside < 0:
            raise ValueError(f"CapturePolicy.expand_beside must be an int >= 0, got {self.expand_beside!r}")
        for name in ("tile_programs", "n_chunk", "k_per_program"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0 or (name != "tile_programs" and v and v & (v - 1)):
                raise ValueError(
                    f"CapturePolicy.{name} must be 0 or a positive {'power of two' if name != 'tile_programs' else 'int'}, got {v!r}"
                )


_CAPTURE = [CapturePolicy()]

# Captured decode launches of the Llama-3-8B projections (in_dim, out widths), measured on the H200 with
# a B=64 capture of rank bound 64: each op of 32 layers in one graph, one launch field varied at a time,
# the sum over 64 distinct r16 / one adapter / 64 q,v r8 / a mixed batch (bench/lora_decode/probe.py).
# qkv: 256-column chunks 101 -> 86 us; o: 128-column tiles 52 -> 48 us; gate_up: 1024-column chunks
# 135 -> 111 us (64 distinct: 42 -> 44 us); down: the occupancy rule was best. Fields: LaunchConfig's.
# Measured at capacity 64; smaller captures (a handful of tile slots) keep the occupancy rule, which
# gives them more, shorter programs than these chunks would.
DECODE_TABLE_MIN_CAPACITY = 64
DECODE_TABLE: dict[tuple[int, tuple[int, ...]], dict[str, int]] = {
    (4096, (4096, 1024, 1024)): {"n_chunk": 256},
    (4096, (4096,)): {"block_n": 128, "n_chunk": 512},
    (4096, (14336, 14336)): {"n_chunk": 1024},
}


# Decode steps of at most this many tiles split shrink's K finer (more programs for a small batch).
FEW_TILES = 16
PREFILL_MAX_SPLIT = 16


def prefill_split_bounds(sms: int) -> tuple[int, ...]:
    """The tile counts at which a prefill's shrink split changes on ``sms`` SMs: pick_config splits K while
    tiles x split < sms, so split s holds from ceil(sms / s) tiles up, for s = 2 up to PREFILL_MAX_SPLIT / 2."""
    out, split = [], 2
    while split < PREFILL_MAX_SPLIT:
        out.append(-(-sms // split))
        split *= 2
    return tuple(out)


def num_sms(device: torch.device) -> int:
    """The device's SM count (4 for a CPU: the interpreter's stand-in), as pick_config sees it."""
    return _num_sms(device)


def capture_policy() -> CapturePolicy:
    return _CAPTURE[0]


def set_capture_policy(**fields) -> CapturePolicy:
    """Replace the captured launches' policy (``CapturePolicy`` fields); returns the old one. Call it before
    a graph is captured: a graph keeps the launches it captured."""
    old = _CAPTURE[0]
    _CAPTURE[0] = CapturePolicy(**fields)
    return old


def pow2_at_least(n: int, lo: int) -> int:
    p = lo
    while p < n:
        p *= 2
    return p


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def pick_config(
    meta: LoRABatchMeta, in_dim: int, out_dims: tuple[int, ...], dtype: torch.dtype
) -> LaunchConfig:
    """Heuristic launch shape (tuned on an H200: bench/kernels/results/kernels-sweep.md). Under ``meta.capture`` it
    depends on the buffers' capacity only, so a captured graph stays valid for any batch that fits.
    Every kernel also keeps a 16-row copy of its loops for tiles of rank <= 16."""
    sms = _num_sms(meta.device)
    policy = _CAPTURE[0] if meta.capture else CapturePolicy()
    tiles_bound = meta.capacity if meta.capture else max(1, meta.host_num_tiles)
    slices_p2 = pow2_at_least(len(out_dims), 1)
    prefill = meta.tile_m >= 64
    # Under capture only the buffers' rank bound is known (rank 128 takes two 64-row passes).
    top = meta.max_rank if meta.capture else meta.host_max_rank
    block_r = min(64, pow2_at_least(top, 16))
    shrink_block_r = max(16, min(block_r, 256 // slices_p2))
    j = shrink_block_r * slices_p2  # width of shrink's A tile; keep its pipelined stages in shared memory
    block_k = (128 if j <= 128 else 64) if not prefill else (64 if j <= 64 else 32)
    if prefill:
        # At least 2 (run 2 sweep: 10-20% over split 1 at T=8192), and more until every SM has a program:
        # with 8 adapters at T=2048 (32 tiles) two splits gave 64 programs for 132 SMs, and the shrink ran
        # at 2-3x its bytes (bench/lora_decode/prefill_probe.py). Each program keeps >= 4 K tiles.
        split = 2
        for first in prefill_split_bounds(sms):  # below a split class's first tile count: split once more
            if tiles_bound >= first or in_dim // (split * 2) < 4 * block_k:
                break
            split *= 2
    else:
        # Split K so each program reads ~256 (tiny batches) to ~1024 columns of A; planes summed by expand.
        k_per = policy.k_per_program or (256 if tiles_bound <= FEW_TILES else 1024)
        split = 1
        while split < 16 and in_dim // (split * 2) >= max(k_per, block_k):
            split *= 2
    gcd = 0
    for w in out_dims:
        gcd = w if gcd == 0 else _gcd(gcd, w)
    total = sum(out_dims)
    cap_n = 128 if prefill else 64
    if gcd & -gcd >= 16:
        # Every width a multiple of 16: column tiles and chunks divide every slice (no masks).
        block_n = min(cap_n, gcd & -gcd)
        # Column chunks: ~2 programs per SM, chunk a power-of-two multiple of block_n dividing every slice,
        # at most 2048 columns (v is reused over up to 32 column tiles).
        n_chunk = block_n
        while (
            n_chunk * 2 <= 2048
            and gcd % (n_chunk * 2) == 0
            and tiles_bound * (total // (n_chunk * 2)) >= 2 * sms
        ):
            n_chunk *= 2
        if policy.n_chunk:  # the largest power of two <= the policy's that divides every width
            n_chunk = block_n
            while n_chunk * 2 <= min(2048, policy.n_chunk) and gcd % (n_chunk * 2) == 0:
                n_chunk *= 2
    else:
        # Ragged widths (e.g. 107, 2049 from tensor-parallel shards): the last column tile of a slice is
        # masked, and chunks stop at the slice's end; same ~2 programs per SM rule.
        widest = pow2_at_least(max(out_dims), 16)
        block_n = min(cap_n, widest)
        n_chunk = block_n
        while (
            n_chunk * 2 <= min(2048, widest)
            and tiles_bound * sum(-(-w // (n_chunk * 2)) for w in out_dims) >= 2 * sms
        ):
            n_chunk *= 2
        if policy.n_chunk:
            n_chunk = max(block_n, min(policy.n_chunk, 2048, widest))
    if meta.capture and policy.decode and not policy.fused and not prefill:
        dn = min(policy.decode_n, pow2_at_least(max(out_dims), 16))  # no wider than the widest slice
        return LaunchConfig(
            block_r=block_r, shrink_block_r=shrink_block_r, block_k=policy.decode_k, block_n=dn,
            n_chunk=dn, decode=True, decode_dot=policy.decode_dot, num_stages=1, pdl=policy.pdl,
            num_warps=policy.decode_warps,
        )  # fmt: skip
    if meta.capture and policy.table and not policy.n_chunk and meta.capacity >= DECODE_TABLE_MIN_CAPACITY:
        tuned = DECODE_TABLE.get((in_dim, tuple(out_dims)), {})
        block_n = tuned.get("block_n", block_n)
        n_chunk = max(block_n, tuned.get("n_chunk", n_chunk))
    return LaunchConfig(
        block_r=block_r, shrink_block_r=shrink_block_r, block_k=block_k, block_n=block_n, n_chunk=n_chunk,
        split_k=split, fused=False, num_stages=3, tile_programs=policy.tile_programs,
        one_launch=meta.capture and policy.fused,
    )  # fmt: skip


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def slice_geometry(out_dims: tuple[int, ...], slice_starts: tuple[int, ...], n_chunk: int,
                   packed_starts: tuple[int, ...] | None = None):  # fmt: skip
    """Compile-time slice table of the expand kernel: (number of column chunks, constexpr kwargs).

    Slice s owns ceil(width_s / n_chunk) chunks; packed B^T columns start at P_s = sum of earlier widths
    (or ``packed_starts[s]``: 0 for slices kept in pools of their own), y columns at slice_starts[s].
    RAGGED is set when some width is not a multiple of n_chunk (masked column tiles); unused entries
    repeat slice 0 so they fold away."""
    geo, begin, packed = {}, 0, 0
    for i, (w, y0) in enumerate(zip(out_dims, slice_starts, strict=True)):
        if packed_starts is not None:
            packed = packed_starts[i]
        if i:
            geo[f"CB{i}"] = begin
        geo[f"OFF{i}"], geo[f"END{i}"], geo[f"DY{i}"] = packed - begin * n_chunk, packed + w, y0 - packed
        begin += -(-w // n_chunk)
        packed += w
    for i in range(len(out_dims), 4):
        geo[f"CB{i}"] = begin
        geo[f"OFF{i}"], geo[f"END{i}"], geo[f"DY{i}"] = geo["OFF0"], geo["END0"], geo["DY0"]
    geo["RAGGED"] = any(w % n_chunk for w in out_dims)
    return begin, geo


def align_hint(stride: int) -> int:
    """Power of two (at most 8) that a row stride is a multiple of, for the kernels' ``_aligned``; 1 (no
    hint) when Triton already knows it (multiples of 16) or nothing helps, so aligned modules compile
    exactly as before."""
    if stride % 16 == 0:
        return 1
    return min(8, stride & -stride) if stride else 1

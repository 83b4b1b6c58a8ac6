"""What a pool or a batch may hold: the rank bound and one LoRA-carrying projection's geometry (``ModuleSpec``).

Shared by the pool, the batch metadata and the engine, so a rank or slice refusal reads the same everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MAX_SLICES", "RANK_LIMIT", "ModuleSpec", "check_max_rank", "rank_error"]


RANK_LIMIT = 512
"""The highest LoRA rank served: a pool's or batch metadata's ``max_rank`` may be at most this. The
operator's ``spec.engine.maxRank`` has the same bound; the kernels are checked up to it on the GPU (their
rank loops run in 64-row chunks, so any rank works; past 512 the float32 shrink output
[split, slices, T, max_rank] would outgrow the activations it serves)."""

MAX_SLICES = 4
"""Packed slices per module: each slice's geometry is a compile-time constant of the expand kernel."""


def rank_error(field: str, rank: object, max_rank: int) -> str:
    """The one wording of a rank refusal, shared by the pool, the batch metadata and the engine."""
    return f"{field}: rank {rank!r} is outside [1, max_rank={max_rank}] (max_rank itself may be at most {RANK_LIMIT})"


def check_max_rank(field: str, max_rank: object, page_rank: int = 1) -> None:
    """A pool or metadata rank bound: a positive multiple of ``page_rank``, at most ``RANK_LIMIT``."""
    if not isinstance(max_rank, int) or not 0 < max_rank <= RANK_LIMIT or max_rank % page_rank:
        raise ValueError(
            f"{field} must be a multiple of page_rank={page_rank} in [1, {RANK_LIMIT}], got {max_rank!r}"
        )


@dataclass(frozen=True, slots=True)
class ModuleSpec:
    """One projection that carries LoRA: ``in_dim`` inputs and one to four output slices.

    q_proj: ModuleSpec(4096, (4096,)); packed qkv: ModuleSpec(4096, (4096, 1024, 1024));
    gate_up: ModuleSpec(4096, (14336, 14336)). Any ``in_dim`` and any widths (tensor-parallel shards give
    widths such as 107 or 2049). ``slice_starts`` places each slice at any column of the base output y
    (default: packed side by side from column 0); ``y_width`` is y's width (default: the last slice's
    end). Columns of y outside every slice are never read or written.

    Still refused, and why: overlapping slices (two kernel programs would add into the same y columns
    without atomics); more than ``MAX_SLICES`` slices (each slice's geometry is a compile-time constant).
    The pool stores B^T packed (``out_starts``, ``out_total``) whatever the slices' places in y.
    """

    in_dim: int
    out_dims: tuple[int, ...]
    slice_starts: tuple[int, ...] | None = None
    y_width: int | None = None

    def __post_init__(self) -> None:
        if not _is_pos_int(self.in_dim):
            raise ValueError(f"ModuleSpec.in_dim must be a positive int, got {self.in_dim!r}")
        if not isinstance(self.out_dims, tuple) or not self.out_dims:
            raise ValueError(f"ModuleSpec.out_dims must be a non-empty tuple, got {self.out_dims!r}")
        if not all(_is_pos_int(w) for w in self.out_dims):
            raise ValueError(f"ModuleSpec.out_dims must be positive ints, got {self.out_dims!r}")
        if len(self.out_dims) > MAX_SLICES:
            raise ValueError(
                f"ModuleSpec.out_dims has {len(self.out_dims)} slices; at most {MAX_SLICES} "
                "(each slice's geometry is a compile-time constant of the expand kernel)"
            )
        starts = self.slice_starts
        if starts is None:
            object.__setattr__(self, "slice_starts", self.out_starts[:-1])
        elif not isinstance(starts, tuple) or len(starts) != len(self.out_dims):
            raise ValueError(
                f"ModuleSpec.slice_starts must be a tuple of {len(self.out_dims)} columns, got {starts!r}"
            )
        elif not all(isinstance(c, int) and c >= 0 for c in starts):
            raise ValueError(f"ModuleSpec.slice_starts must be ints >= 0, got {starts!r}")
        spans = sorted(zip(self.slice_starts, self.out_dims, strict=True))
        for (c0, w0), (c1, _) in zip(spans, spans[1:], strict=False):
            if c0 + w0 > c1:
                raise ValueError(
                    f"ModuleSpec.slice_starts {self.slice_starts!r}: slices overlap at columns {c1}..{c0 + w0 - 1} "
                    "(two kernel programs would add into the same y columns without atomics)"
                )
        end = max(c + w for c, w in spans)
        if self.y_width is None:
            object.__setattr__(self, "y_width", end)
        elif not _is_pos_int(self.y_width) or self.y_width < end:
            raise ValueError(
                f"ModuleSpec.y_width must be an int >= {end} (the last slice's end), got {self.y_width!r}"
            )

    @property
    def num_slices(self) -> int:
        return len(self.out_dims)

    @property
    def out_total(self) -> int:
        """Columns of the packed B^T in the pool (the sum of the widths)."""
        return sum(self.out_dims)

    @property
    def out_starts(self) -> tuple[int, ...]:
        """Column where each slice starts in the packed B^T, plus the total: (0, w0, w0+w1, ..., out_total)."""
        starts = [0]
        for w in self.out_dims:
            starts.append(starts[-1] + w)
        return tuple(starts)

    def row_elems(self) -> int:
        """Elements one rank-row costs in this module: one A row per slice plus one B^T row."""
        return self.num_slices * self.in_dim + self.out_total


def _is_pos_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0

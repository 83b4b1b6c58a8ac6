"""Engine configuration: one slotted dataclass that validates itself (torch-free)."""

from __future__ import annotations

import math
from dataclasses import dataclass

_DTYPES = ("auto", "bfloat16", "float16", "float32")
_DEVICES = ("auto", "cuda", "cpu")
# PEFT module names an adapter may target (engine/lora/weights.py TARGET_MODULES, kept torch-free here)
PEFT_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# lora_graph_module_sets for adapters on the attention projections: q,v-only and q,k,v,o-only steps
ATTENTION_MODULE_SETS = (("q_proj", "v_proj"), ("q_proj", "k_proj", "v_proj", "o_proj"))


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"EngineConfig.{field}: {message}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_seconds(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(slots=True)
class EngineConfig:
    model: str  # path to an HF folder (config.json + safetensors)
    dtype: str = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    device: str = "auto"  # auto: cuda when available
    block_size: int = 16  # KV tokens per block
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None  # default: min(config max_position_embeddings, 8192)
    gpu_memory_utilization: float = 0.85  # fraction of free GPU memory for weights + KV
    num_kv_blocks: int | None = None  # explicit override (CPU default: from cpu_kv_cache_bytes)
    cpu_kv_cache_bytes: int = 1 << 30
    enforce_eager: bool = False  # no CUDA graphs
    cuda_graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    seed: int = 0
    tensor_parallel_size: int = 1  # processes (one per GPU) the base is split over; see parallel/
    enable_prefix_caching: bool = True  # reuse the KV of full blocks shared with earlier requests
    # How long later arrivals may be admitted ahead of a waiting request (grouping by adapter, resident
    # adapters first, skipping a loading adapter); after that it goes first and nothing later is admitted before it.
    max_passed_over_s: float = 2.0
    # Refuse new requests (overloaded) while this many wait; None: no limit.
    max_waiting_seqs: int | None = None
    max_queue_wait_s: float | None = None  # refuse new requests while queued ones already wait longer
    adapter_load_timeout_s: float = 60.0  # a request whose adapter is still not resident after this fails
    # Adapters (multi-LoRA). The GPU pools hold max_loras adapters of max_lora_rank on every module (more of
    # lower rank or fewer modules); lora_pool_bytes, when set, sizes them in bytes instead.
    enable_lora: bool = True
    max_lora_rank: int = 64
    max_loras: int = 8
    lora_pool_bytes: int | None = None
    lora_host_bytes: int = 8 << 30  # pinned host RAM for parsed adapters (LRU)
    # Merge a dominant adapter into a copy of the projection weights (engine/lora/merge.py): a step whose
    # tokens all carry it then costs a base step. The copy costs the projections' bytes again (13.96 GB on
    # Llama-3-8B in bf16), taken from KV. Merged after lora_merge_after_steps steps of that adapter alone;
    # unmerged once its share of a step's tokens falls below lora_merge_stay_share. Tensor parallel: off.
    lora_merge: bool = False
    lora_merge_after_steps: int = 8
    lora_merge_stay_share: float = 0.56
    # Extra CUDA-graph families for decode steps whose adapters use only these modules: such a step
    # launches LoRA kernels for these modules alone, not for all seven (a q,v-only step: 2 launches a layer
    # instead of 8). Each family costs a capture at start and its logits buffers (buckets x vocab x 4 bytes,
    # taken from KV). The default covers PEFT's default targets for Llama-style models (q,v) and the
    # attention-only adapters (q,k,v,o): on the H200's 8B shape a q,v-only B=64 step is 7.84 ms with its
    # family against 8.41 ms with every module's launches; the two families' logits buffers take about 0.5 GB
    # of KV with a 128k vocabulary. () captures none; tensor parallel captures none.
    lora_graph_module_sets: tuple[tuple[str, ...], ...] = ATTENTION_MODULE_SETS
    # "split": KV blocks and the adapter pools have fixed sizes. "unified": one arena per layer holds both, and
    # the share moves at run time (many adapters and short contexts: more adapters; long contexts: more KV).
    # Same total memory either way. Tensor parallel serves only "split".
    memory_mode: str = "split"
    # Compile the LoRA kernels of every rank class and step size at start (engine/model/lora_warmup.py), so
    # that the first steps with a new rank or prompt size do not stall every tenant while Triton compiles.
    # About 150 kernels for a Llama-3-8B shape, compiled on up to 16 threads; with no Triton cache (a new node:
    # the operator keeps it on the host-cache volume) that is minutes of CPU. CUDA devices only; tensor
    # parallel: off.
    lora_kernel_warmup: bool = True

    def __post_init__(self) -> None:
        _require(isinstance(self.model, str) and self.model != "", "model", "must be a non-empty path")
        _require(self.dtype in _DTYPES, "dtype", f"must be one of {_DTYPES}, got {self.dtype!r}")
        _require(self.device in _DEVICES, "device", f"must be one of {_DEVICES}, got {self.device!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            _require(_is_int(value) and value > 0, name, f"must be a positive int, got {value!r}")
        _require(
            self.block_size & (self.block_size - 1) == 0,
            "block_size",
            f"must be a power of two, got {self.block_size}",
        )
        if self.max_model_len is not None:
            _require(
                _is_int(self.max_model_len) and self.max_model_len > 0,
                "max_model_len",
                f"must be a positive int or None, got {self.max_model_len!r}",
            )
        _require(
            isinstance(self.gpu_memory_utilization, int | float) and 0.0 < self.gpu_memory_utilization <= 1.0,
            "gpu_memory_utilization",
            f"must be in (0, 1], got {self.gpu_memory_utilization!r}",
        )
        if self.num_kv_blocks is not None:
            _require(
                _is_int(self.num_kv_blocks) and self.num_kv_blocks > 0,
                "num_kv_blocks",
                f"must be a positive int or None, got {self.num_kv_blocks!r}",
            )
        _require(
            _is_int(self.cpu_kv_cache_bytes) and self.cpu_kv_cache_bytes > 0,
            "cpu_kv_cache_bytes",
            f"must be a positive int, got {self.cpu_kv_cache_bytes!r}",
        )
        _require(isinstance(self.enforce_eager, bool), "enforce_eager", "must be a bool")
        _require(isinstance(self.lora_kernel_warmup, bool), "lora_kernel_warmup", "must be a bool")
        self.cuda_graph_batch_sizes = tuple(self.cuda_graph_batch_sizes)
        sizes = self.cuda_graph_batch_sizes
        _require(
            all(_is_int(s) and s > 0 for s in sizes) and list(sizes) == sorted(set(sizes)),
            "cuda_graph_batch_sizes",
            f"must be strictly increasing positive ints, got {sizes!r}",
        )
        _require(_is_int(self.seed), "seed", f"must be an int, got {self.seed!r}")
        _require(
            _is_int(self.tensor_parallel_size) and self.tensor_parallel_size > 0,
            "tensor_parallel_size",
            f"must be a positive int, got {self.tensor_parallel_size!r}",
        )
        _require(isinstance(self.enable_prefix_caching, bool), "enable_prefix_caching", "must be a bool")
        _require(
            _is_seconds(self.max_passed_over_s) and self.max_passed_over_s >= 0.0,
            "max_passed_over_s",
            f"must be a finite number of seconds >= 0, got {self.max_passed_over_s!r}",
        )
        if self.max_waiting_seqs is not None:
            _require(
                _is_int(self.max_waiting_seqs) and self.max_waiting_seqs > 0,
                "max_waiting_seqs",
                f"must be a positive int or None, got {self.max_waiting_seqs!r}",
            )
        if self.max_queue_wait_s is not None:
            _require(
                _is_seconds(self.max_queue_wait_s) and self.max_queue_wait_s > 0.0,
                "max_queue_wait_s",
                f"must be a positive finite number of seconds or None, got {self.max_queue_wait_s!r}",
            )
        _require(
            _is_seconds(self.adapter_load_timeout_s) and self.adapter_load_timeout_s > 0.0,
            "adapter_load_timeout_s",
            f"must be a positive finite number of seconds, got {self.adapter_load_timeout_s!r}",
        )
        _require(isinstance(self.enable_lora, bool), "enable_lora", "must be a bool")
        for name in ("max_lora_rank", "max_loras", "lora_host_bytes"):
            value = getattr(self, name)
            _require(_is_int(value) and value > 0, name, f"must be a positive int, got {value!r}")
        _require(isinstance(self.lora_merge, bool), "lora_merge", "must be a bool")
        _require(
            not self.lora_merge or (self.enable_lora and self.tensor_parallel_size == 1),
            "lora_merge",
            "needs enable_lora and tensor_parallel_size 1 (tensor parallel serves adapters unmerged)",
        )
        _require(
            _is_int(self.lora_merge_after_steps) and self.lora_merge_after_steps > 0,
            "lora_merge_after_steps",
            f"must be a positive int, got {self.lora_merge_after_steps!r}",
        )
        _require(
            isinstance(self.lora_merge_stay_share, int | float) and 0.0 < self.lora_merge_stay_share <= 1.0,
            "lora_merge_stay_share",
            f"must be in (0, 1], got {self.lora_merge_stay_share!r}",
        )
        _require(
            self.memory_mode in ("split", "unified"),
            "memory_mode",
            f"must be 'split' or 'unified', got {self.memory_mode!r}",
        )
        _require(
            self.memory_mode == "split" or self.tensor_parallel_size == 1,
            "memory_mode",
            "'unified' is served with tensor_parallel_size 1 only (tensor parallel keeps the split)",
        )
        self.lora_graph_module_sets = _module_sets(self.lora_graph_module_sets)
        if self.lora_pool_bytes is not None:
            _require(
                _is_int(self.lora_pool_bytes) and self.lora_pool_bytes > 0,
                "lora_pool_bytes",
                f"must be a positive int or None, got {self.lora_pool_bytes!r}",
            )


def _module_sets(value: object) -> tuple[tuple[str, ...], ...]:
    """lora_graph_module_sets as a tuple of tuples of PEFT module names, each non-empty and known."""
    ok = isinstance(value, list | tuple) and all(
        isinstance(s, list | tuple) and s and all(m in PEFT_MODULES for m in s) for s in value
    )
    _require(
        ok,
        "lora_graph_module_sets",
        f"must be a tuple of non-empty tuples of module names from {PEFT_MODULES}, got {value!r}",
    )
    return tuple(tuple(s) for s in value)

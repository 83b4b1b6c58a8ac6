"""Small fused element-wise ops of the decoder: RMSNorm (+ residual add), SiLU-and-multiply, RoPE.

Why fused: a decode step of an 8B model launches ~12 kernels per layer; unfused torch RMSNorm and RoPE
add ~20 tiny launches per layer, which costs ~2 ms per step even under CUDA graphs. Each op has a Triton
kernel (CUDA tensors) and a plain-torch reference (CPU, and the tests' ground truth), same semantics;
``triton_=True`` forces the kernel (the tests run it on CPU under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplane.kernels.pdl import launch_dependents, pdl_available, pdl_option, wait_for_kernel_ahead

_PDL = [False]


def set_model_pdl(on: bool) -> bool:
    """Launch the decoder's own Triton kernels (RMSNorm, SiLU-and-multiply, RoPE and KV store, paged decode
    attention and its merge) with programmatic dependent launch where the GPU has it (kernels/pdl.py): each
    waits for the kernel ahead before its first load, so only its launch overlaps that kernel's tail.
    Returns the previous setting; set it before CUDA graphs are captured."""
    old, _PDL[0] = _PDL[0], bool(on)
    return old


def model_pdl(t: torch.Tensor) -> bool:
    """Whether the decoder's kernels on ``t``'s device go out with programmatic dependent launch."""
    return _PDL[0] and pdl_available(t)


def model_pdl_args(t: torch.Tensor) -> dict:
    """A decoder kernel's ``GDC`` flag and launch option for a launch on ``t``'s device."""
    on = model_pdl(t)
    return {"GDC": on, **pdl_option(on)}


# ---------------------------------------------------------------------------------------------- RMSNorm
@triton.jit
def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, N, eps,
                    HAS_RES: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr):  # fmt: skip
    wait_for_kernel_ahead(GDC)
    launch_dependents(GDC)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        # residual += x, kept in the activation dtype exactly as the unfused model rounds it
        x = x + tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = x.to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_r + cols, x, mask=mask)
        x = x.to(tl.float32)
    var = tl.sum(x * x, axis=0) / N
    y = (x * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, y * w, mask=mask)


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: normalise in fp32, cast back, then scale."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    triton_: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x: [T, H]; residual: [T, H] or None. With a residual: residual += x in place, return norm(residual).

    Returns (normed [T, H], residual).
    """
    if not (x.is_cuda if triton_ is None else triton_):
        if residual is not None:
            residual.add_(x)
            x = residual
        return rmsnorm_ref(x, weight, eps), residual
    assert x.dim() == 2 and x.stride(-1) == 1, x.shape
    T, N = x.shape
    out = torch.empty_like(x)
    res = residual if residual is not None else x
    _rmsnorm_kernel[(T,)](x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), N, eps,
                          HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(N), num_warps=8,
                          **model_pdl_args(x))  # fmt: skip
    return out, residual


# ------------------------------------------------------------------------------------------ SiLU * up
@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, N, BLOCK: tl.constexpr, GDC: tl.constexpr):
    wait_for_kernel_ahead(GDC)
    launch_dependents(GDC)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(x_ptr + row * 2 * N + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * 2 * N + N + cols, mask=mask, other=0.0)
    silu = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * N + cols, silu * u, mask=mask)


def silu_mul(gate_up: torch.Tensor, triton_: bool | None = None) -> torch.Tensor:
    """gate_up: [T, 2F] contiguous, gate | up -> silu(gate) * up  [T, F]."""
    F_ = gate_up.shape[-1] // 2
    if not (gate_up.is_cuda if triton_ is None else triton_):
        return torch.nn.functional.silu(gate_up[:, :F_]) * gate_up[:, F_:]
    assert gate_up.is_contiguous()
    T = gate_up.shape[0]
    out = gate_up.new_empty((T, F_))
    BLOCK = 1024
    _silu_mul_kernel[(T, triton.cdiv(F_, BLOCK))](gate_up, out, F_, BLOCK=BLOCK, num_warps=4,
                                                  **model_pdl_args(gate_up))  # fmt: skip
    return out


# ------------------------------------------------------------------------------------ RoPE + KV store
@triton.jit
def _rope_store_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slot_ptr, stride_t,
                       NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                       BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr, GDC: tl.constexpr):  # fmt: skip
    """One token per program: rotate its q and k heads in place, then store its k and v heads at its KV slot."""
    wait_for_kernel_ahead(GDC)
    launch_dependents(GDC)
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < HALF
    dt = qkv_ptr.dtype.element_ty
    cos = tl.load(cos_ptr + pos * HALF + d, mask=dmask, other=0.0).to(dt).to(tl.float32)  # HF casts cos/sin
    sin = tl.load(sin_ptr + pos * HALF + d, mask=dmask, other=0.0).to(dt).to(tl.float32)
    h = tl.arange(0, BLOCK_H)[:, None]  # head index in [q heads | k heads | v heads]
    mask = (h < NUM_Q + 2 * NUM_KV) & dmask[None, :]
    base = qkv_ptr + t * stride_t + h * D + d[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    # HF computes q*cos and rotate_half(q)*sin in the activation dtype; round each product likewise
    o1 = (x1 * cos[None, :]).to(dt).to(tl.float32) - (x2 * sin[None, :]).to(dt).to(tl.float32)
    o2 = (x2 * cos[None, :]).to(dt).to(tl.float32) + (x1 * sin[None, :]).to(dt).to(tl.float32)
    rot = mask & (h < NUM_Q + NUM_KV)
    o1 = tl.where(rot, o1, x1).to(dt)
    o2 = tl.where(rot, o2, x2).to(dt)
    tl.store(base, o1, mask=rot)
    tl.store(base + HALF, o2, mask=rot)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        row = slot * (NUM_KV * D)
        is_k = mask & (h >= NUM_Q) & (h < NUM_Q + NUM_KV)
        is_v = mask & (h >= NUM_Q + NUM_KV)
        k_off = kc_ptr + row + (h - NUM_Q) * D + d[None, :]
        v_off = vc_ptr + row + (h - NUM_Q - NUM_KV) * D + d[None, :]
        tl.store(k_off, o1, mask=is_k)
        tl.store(k_off + HALF, o2, mask=is_k)
        tl.store(v_off, o1, mask=is_v)
        tl.store(v_off + HALF, o2, mask=is_v)


def rope_ref(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos/sin: [max_pos, D/2] fp32 -> rotated x (neox / HF rotate_half layout)."""
    c = cos.index_select(0, positions).to(x.dtype)[:, None, :].repeat(1, 1, 2)  # [T, 1, D]
    s = sin.index_select(0, positions).to(x.dtype)[:, None, :].repeat(1, 1, 2)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * c + rotated * s


def rope_and_store_kv(qkv: torch.Tensor, num_q: int, num_kv: int, positions: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      triton_: bool | None = None) -> None:  # fmt: skip
    """In place on qkv: [T, num_q + 2*num_kv, D] (q | k | v heads): rotate q and k; store k, v in the caches
    [N, block_size, num_kv, D] at slot_mapping [T] (-1: no store; an empty cache: no store)."""
    store = k_cache.numel() > 0
    if not (qkv.is_cuda if triton_ is None else triton_):
        qk = qkv[:, : num_q + num_kv]
        qk.copy_(rope_ref(qk, positions, cos, sin))
        if store:
            slots, k, v = slot_mapping, qkv[:, num_q : num_q + num_kv], qkv[:, num_q + num_kv :]
            keep = slot_mapping >= 0  # [T] rows that store (a warm-up forward stores nothing)
            if not bool(keep.all()):  # the mask costs a nonzero and three gathers per layer: only when needed
                slots, k, v = slots[keep], k[keep], v[keep]
            k_cache.view(-1, num_kv, qkv.shape[-1]).index_copy_(0, slots, k)
            v_cache.view(-1, num_kv, qkv.shape[-1]).index_copy_(0, slots, v)
        return
    T, H, D = qkv.shape
    assert H == num_q + 2 * num_kv and qkv.stride(1) == D and qkv.stride(2) == 1 and D % 2 == 0
    if not store:  # profiling run before the cache exists: rotate only
        k_cache = v_cache = qkv
        slot_mapping = torch.full((T,), -1, dtype=torch.int64, device=qkv.device)
    _rope_store_kernel[(T,)](qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, qkv.stride(0),
                             NUM_Q=num_q, NUM_KV=num_kv, D=D, HALF=D // 2,
                             BLOCK_HALF=triton.next_power_of_2(D // 2), BLOCK_H=triton.next_power_of_2(H),
                             num_warps=4, **model_pdl_args(qkv))  # fmt: skip

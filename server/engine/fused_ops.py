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


# ---------------------------------------------------------------------------------------------- RMSNorm
@triton.jit
def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, N, eps,
                    HAS_RES: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
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
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, triton_: bool | None = None
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
                          HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(N), num_warps=8)  # fmt: skip
    return out, residual


# ------------------------------------------------------------------------------------------ SiLU * up
@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, N, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(g_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * N + cols, mask=mask, other=0.0)
    silu = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * N + cols, silu * u, mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, triton_: bool | None = None) -> torch.Tensor:
    """gate, up: [T, F] contiguous -> silu(gate) * up  [T, F]."""
    if not (gate.is_cuda if triton_ is None else triton_):
        return torch.nn.functional.silu(gate) * up
    assert gate.is_contiguous() and up.is_contiguous() and gate.shape == up.shape
    T, N = gate.shape
    out = torch.empty_like(gate)
    BLOCK = 1024
    _silu_mul_kernel[(T, triton.cdiv(N, BLOCK))](gate, up, out, N, BLOCK=BLOCK, num_warps=4)
    return out


# ------------------------------------------------------------------------------------------------ RoPE
@triton.jit
def _rope_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, stride_t, stride_h, HALF: tl.constexpr,
                 BLOCK_H: tl.constexpr, NUM_HEADS: tl.constexpr):  # fmt: skip
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    d = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + pos * HALF + d)  # fp32 [HALF]
    sin = tl.load(sin_ptr + pos * HALF + d)
    cos = cos.to(x_ptr.dtype.element_ty).to(tl.float32)  # HF casts cos/sin to the activation dtype
    sin = sin.to(x_ptr.dtype.element_ty).to(tl.float32)
    h = tl.arange(0, BLOCK_H)
    hmask = h[:, None] < NUM_HEADS
    base = x_ptr + t * stride_t + h[:, None] * stride_h + d[None, :]
    x1 = tl.load(base, mask=hmask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=hmask, other=0.0).to(tl.float32)
    # HF computes q*cos and rotate_half(q)*sin in the activation dtype; round each product likewise
    dt = x_ptr.dtype.element_ty
    o1 = (x1 * cos[None, :]).to(dt).to(tl.float32) - (x2 * sin[None, :]).to(dt).to(tl.float32)
    o2 = (x2 * cos[None, :]).to(dt).to(tl.float32) + (x1 * sin[None, :]).to(dt).to(tl.float32)
    tl.store(base, o1.to(dt), mask=hmask)
    tl.store(base + HALF, o2.to(dt), mask=hmask)


def rope_ref(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos/sin: [max_pos, D/2] fp32 -> rotated x (neox / HF rotate_half layout)."""
    c = cos[positions].to(x.dtype)[:, None, :].repeat(1, 1, 2)  # [T, 1, D]
    s = sin[positions].to(x.dtype)[:, None, :].repeat(1, 1, 2)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * c + rotated * s


def apply_rope_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                triton_: bool | None = None) -> torch.Tensor:  # fmt: skip
    """In place on x: [T, heads, D] (last dim contiguous); positions: [T] int64."""
    if not (x.is_cuda if triton_ is None else triton_):
        x.copy_(rope_ref(x, positions, cos, sin))
        return x
    T, H, D = x.shape
    assert x.stride(-1) == 1 and D % 2 == 0
    _rope_kernel[(T,)](x, positions, cos, sin, x.stride(0), x.stride(1), HALF=D // 2,
                       BLOCK_H=triton.next_power_of_2(H), NUM_HEADS=H, num_warps=4)  # fmt: skip
    return x

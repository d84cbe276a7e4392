"""Weight-only quantization of Linear weights: the numbers, the stored layout, the reference.

A weight ``W`` (N, K) is split along its input dimension into ``G = ceil(K / group_size)``
groups per output row (``group_size=None``: one group per row, i.e. per output channel; the
last group is shorter when ``group_size`` does not divide K). Each (row, group) gets a float32
scale ``s`` and, when asymmetric, an integer zero point ``z``; a weight is stored as the integer
``q = clamp(round(w / s) + z, qmin, qmax)`` and means ``(q - z) * s`` (float32).

=========  ==========  ================================  ===================================
bits       symmetric   ``q`` range, ``s``                storage of ``q`` / of ``z``
=========  ==========  ================================  ===================================
8          yes         [-127, 127], ``amax / 127``       int8 (N, K) / none (0)
8          no          [-128, 127], ``range / 255``      int8 (N, K) / int8 (N, G)
4          yes         [0, 15], ``amax / 7``, z = 8      uint8 (N, 16 ceil(K / 32)) / none (8)
4          no          [0, 15], ``range / 15``           same / uint8 (N, G)
=========  ==========  ================================  ===================================

(``amax``: the group's largest ``|w|``; ``range``: ``max(w, 0) - min(w, 0)``, so 0 is exact;
an all-zero group gets scale 1.) int4 values are packed two per byte in blocks of 32 inputs:
byte ``16 b + i`` of a row holds input ``32 b + i`` in its low nibble and ``32 b + 16 + i`` in
its high one, padding past K holds the zero point (:func:`pack_int4`; the layout the C and
Triton kernels unpack with one AND and one shift per vector). ``group_size`` must be a multiple
of 32 so groups never split a block.

:func:`woq_reference` is the definition every kernel is checked against:
``F.linear(x, dequantize_weight(...), bias)``.

**Activations** stay float by default (``activations="float"``: weight-only proper). With
``activations="int8"`` each call first rounds ``x`` to int8 in blocks of 32 inputs, each block
with its own scale (:func:`round_activations`; the scheme llama.cpp pairs with its 4-bit
weights), so that a kernel can multiply and sum in integers (AVX512-VNNI or AVX2): a decode GEMV then
reads its int4 weight at the memory's speed instead of being bound by unpacking to float. The
price is the rounding of ``x``: at most half a step, ``amax / 254``, per block of 32.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["WoqWeight", "quantize_weight_only", "dequantize_weight", "pack_int4", "unpack_int4", "woq_reference",
           "round_activations", "group_count", "check_scheme", "check_activations", "check_stored", "stored_bytes",
           "ACTIVATIONS", "ACT_BLOCK"]

#: what ``activations=`` accepts
ACTIVATIONS = ("float", "int8")
#: inputs per block of ``activations="int8"`` (one scale each)
ACT_BLOCK = 32


def check_scheme(bits: int, group_size: Optional[int]) -> None:
    """Raise ``ValueError`` for an unsupported ``bits``/``group_size``."""
    if bits not in (4, 8) or isinstance(bits, bool):
        raise ValueError(f"weight-only quantization supports bits=8 or bits=4, got bits={bits!r}")
    if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int)
                                   or group_size <= 0 or group_size % 32):
        raise ValueError(f"group_size must be None (one group per output channel) or a positive multiple of 32 "
                         f"(32, 64, 128, ...), got {group_size!r}")


def check_activations(activations: str) -> None:
    """Raise ``ValueError`` unless ``activations`` is one of :data:`ACTIVATIONS`."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be 'float' (weight-only: x stays float) or 'int8' (x rounded to int8 "
                         f"per block of {ACT_BLOCK} inputs on each call), got {activations!r}")


def group_count(k: int, group_size: Optional[int]) -> int:
    """Groups per output row: ``ceil(K / group_size)``, or 1 per row (0 when K is 0)."""
    if group_size is None:
        return 1 if k > 0 else 0
    return -(-k // group_size)


def _group_len(k: int, group_size: Optional[int]) -> int:
    return max(k, 1) if group_size is None else group_size


@dataclass(frozen=True)
class WoqWeight:
    """A quantized weight: ``qweight`` (stored layout), ``scale`` float32 (N, G), ``zero``
    (N, G) or None (symmetric), and what is needed to read them back."""

    qweight: torch.Tensor
    scale: torch.Tensor
    zero: Optional[torch.Tensor]
    bits: int
    group_size: Optional[int]
    in_features: int


def _grouped(w: torch.Tensor, group_size: Optional[int]) -> torch.Tensor:
    """(N, K) -> (N, G, gs), zero-padded at the end of K."""
    n, k = w.shape
    gs, g = _group_len(k, group_size), group_count(k, group_size)
    if g * gs != k:
        w = F.pad(w, (0, g * gs - k))
    return w.reshape(n, g, gs)


def quantize_weight_only(w: torch.Tensor, bits: int = 8, group_size: Optional[int] = None,
                         symmetric: bool = True) -> WoqWeight:
    """Quantize a float weight (N, K) as the module docstring says (float32 arithmetic, round
    half to even). Raises ``ValueError`` when ``w`` holds NaN or infinity."""
    check_scheme(bits, group_size)
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"weight-only quantization expects a 2-D float weight, got {w.dtype} {tuple(w.shape)}")
    w = w.detach().to(torch.float32)
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"the weight {tuple(w.shape)} holds NaN or infinity; it cannot be quantized")
    n, k = w.shape
    wg = _grouped(w, group_size)
    if symmetric:
        qmin, qmax = (-127, 127) if bits == 8 else (-7, 7)
        amax = wg.abs().amax(-1) if wg.shape[-1] else torch.zeros(wg.shape[:2])
        scale = amax / qmax
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        zp = torch.zeros_like(scale) if bits == 8 else torch.full_like(scale, 8.0)
        lo, hi = (-127, 127) if bits == 8 else (0, 15)
    else:
        lo, hi = (-128, 127) if bits == 8 else (0, 15)
        mn = wg.amin(-1).clamp(max=0) if wg.shape[-1] else torch.zeros(wg.shape[:2])
        mx = wg.amax(-1).clamp(min=0) if wg.shape[-1] else torch.zeros(wg.shape[:2])
        scale = (mx - mn) / float(hi - lo)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        zp = torch.clamp(torch.round(lo - mn / scale), lo, hi)
    q = torch.clamp(torch.round(wg / scale.unsqueeze(-1)) + zp.unsqueeze(-1), lo, hi)
    q = q.reshape(n, wg.shape[1] * wg.shape[2])[:, :k]
    zero = None if symmetric else zp.to(torch.int8 if bits == 8 else torch.uint8)
    if bits == 8:
        qweight = q.to(torch.int8).contiguous()
    else:
        qweight = pack_int4(q.to(torch.uint8), pad=8 if symmetric else zp.to(torch.uint8)[:, -1:] if zp.numel() else 8)
    return WoqWeight(qweight, scale.contiguous(), zero if zero is None else zero.contiguous(), bits, group_size, k)


def pack_int4(q: torch.Tensor, pad=8) -> torch.Tensor:
    """uint8 values 0..15 (N, K) -> (N, 16 ceil(K / 32)) uint8 in the blocked nibble layout;
    ``pad`` (a number or an (N, 1) tensor): the value of the nibbles past K."""
    n, k = q.shape
    kb = -(-k // 32)
    full = torch.empty(n, kb * 32, dtype=torch.uint8)
    full[:, k:] = pad if not isinstance(pad, torch.Tensor) else pad.to(torch.uint8)
    full[:, :k] = q
    blocks = full.reshape(n, kb, 2, 16)
    return (blocks[:, :, 0, :] | (blocks[:, :, 1, :] << 4)).reshape(n, kb * 16).contiguous()


def unpack_int4(packed: torch.Tensor, k: int) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: (N, K) uint8 values 0..15."""
    n, kb = packed.shape[0], packed.shape[1] // 16
    blocks = packed.reshape(n, kb, 16)
    return torch.stack((blocks & 15, blocks >> 4), 2).reshape(n, kb * 32)[:, :k]


def dequantize_weight(qweight: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor], bits: int,
                      group_size: Optional[int], in_features: int) -> torch.Tensor:
    """The float32 weight (N, K) a quantized one means: ``(q - z) * s`` per (row, group)."""
    k = in_features
    q = (qweight if bits == 8 else unpack_int4(qweight, k)).to(torch.float32)
    n = q.shape[0]
    z = zero.to(torch.float32) if zero is not None else torch.full_like(scale, 0.0 if bits == 8 else 8.0)
    gs = _group_len(k, group_size)
    idx = torch.arange(k, device=q.device) // gs
    return (q - z[:, idx]) * scale[:, idx] if n and k else torch.zeros(n, k)


def round_activations(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``activations="int8"`` sees it: along the last dimension, each block of
    :data:`ACT_BLOCK` inputs (the last one shorter) is rounded to ``q = round(x * (127 / amax))``
    (float32, half to even; ``amax`` the block's largest ``|x|``) and read back as
    ``q * (amax / 127)``, in ``x``'s dtype. An all-zero block stays zero; a block holding NaN
    or an infinity is left as it is, so they propagate as in the float matmul."""
    k = x.shape[-1]
    if k == 0 or x.numel() == 0:
        return x
    xf = x.to(torch.float32)
    nb = -(-k // ACT_BLOCK)
    if nb * ACT_BLOCK != k:
        xf = F.pad(xf, (0, nb * ACT_BLOCK - k))
    blocks = xf.reshape(*x.shape[:-1], nb, ACT_BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    # 127 / amax as one correctly rounded float32 division, as the C kernels compute it (torch
    # evaluates ``127.0 / tensor`` as ``reciprocal(tensor) * 127``, an ulp off at times, which
    # moves products that land on .5 to the other side)
    # A block whose amax is below 2^-64 is first scaled by 2^64 (exact): 127 / amax overflows
    # float32 below about 3.7e-37, and elsewhere the scaling leaves every product as it was.
    up = torch.where(amax < 2.0 ** -64, torch.full_like(amax, 2.0 ** 64), torch.ones_like(amax))
    inv = torch.where(amax > 0, torch.div(torch.full_like(amax, 127.0), amax * up), torch.zeros_like(amax))
    rounded = torch.round((blocks * up) * inv).clamp(-127, 127) * (amax / 127.0)
    finite = torch.isfinite(amax)  # (amax propagates NaN)
    out = torch.where(finite, rounded, blocks).reshape(*x.shape[:-1], nb * ACT_BLOCK)[..., :k]
    return out.to(x.dtype)


def woq_reference(x: torch.Tensor, qweight, scale, zero, bias, bits: int, group_size: Optional[int],
                  in_features: int, activations: str = "float") -> torch.Tensor:
    """``F.linear(x, dequantize_weight(...), bias)`` in ``x``'s dtype: the definition (with
    ``activations="int8"``, ``x`` first goes through :func:`round_activations`)."""
    check_stored(qweight, scale, zero, bias, bits, group_size, in_features)
    check_activations(activations)
    if activations == "int8":
        x = round_activations(x)
    w = dequantize_weight(qweight, scale, zero, bits, group_size, in_features).to(x.device, x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.device, x.dtype))


def stored_bytes(q: WoqWeight) -> int:
    """Bytes of the quantized weight's tensors (values, scales, zero points)."""
    return sum(t.numel() * t.element_size() for t in (q.qweight, q.scale, q.zero) if t is not None)


def check_stored(qweight, scale, zero, bias, bits: int, group_size, k: int) -> None:
    """Raise ``ValueError`` when the stored tensors do not fit together (a hand-edited graph)."""
    check_scheme(bits, group_size)
    n, g = qweight.shape[0] if qweight.dim() == 2 else -1, group_count(k, group_size)
    want_w = (torch.int8, (n, k)) if bits == 8 else (torch.uint8, (n, 16 * -(-k // 32)))
    problems = []
    if qweight.dim() != 2 or (qweight.dtype, tuple(qweight.shape)) != want_w:
        problems.append(f"qweight is {qweight.dtype} {tuple(qweight.shape)}, expected {want_w[0]} {want_w[1]}")
    if tuple(scale.shape) != (n, g) or not scale.is_floating_point():
        problems.append(f"scale is {scale.dtype} {tuple(scale.shape)}, expected float ({n}, {g})")
    zdt = torch.int8 if bits == 8 else torch.uint8
    if zero is not None and (tuple(zero.shape) != (n, g) or zero.dtype is not zdt):
        problems.append(f"zero is {zero.dtype} {tuple(zero.shape)}, expected {zdt} ({n}, {g})")
    if bias is not None and tuple(bias.shape) != (n,):
        problems.append(f"bias has shape {tuple(bias.shape)}, expected ({n},)")
    if problems:
        raise ValueError(f"woq_linear (bits={bits}, group_size={group_size}, in_features={k}): "
                         + "; ".join(problems))

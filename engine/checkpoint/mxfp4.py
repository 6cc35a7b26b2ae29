"""MXFP4 weights (OCP microscaling FP4), as K3's checkpoint stores them: ``<name>.weight_packed``
uint8 [out, in/2], two E2M1 codes a byte (the low nibble is the even element), and
``<name>.weight_scale`` uint8 [out, in/32], one E8M0 exponent per 32 elements:

    w[o, i] = FP4[code(o, i)] * 2^(scale[o, i // 32] - 127)
    FP4 = [0, .5, 1, 1.5, 2, 3, 4, 6, -0, -.5, -1, -1.5, -2, -3, -4, -6]

``dequantize`` is the fast form (a table lookup and an exact power-of-two scaling);
``decode_reference`` the definition, from the bits of each code, used to verify it.
"""

from __future__ import annotations

import torch

PACKED, SCALE = ".weight_packed", ".weight_scale"
FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32


def _check(packed: torch.Tensor, scale: torch.Tensor) -> None:
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"MXFP4 tensors are uint8, got {packed.dtype} and {scale.dtype}")
    if packed.shape[:-1] != scale.shape[:-1] or packed.shape[-1] != scale.shape[-1] * GROUP // 2:
        raise ValueError(
            f"MXFP4 shapes do not match: packed {tuple(packed.shape)}, scale {tuple(scale.shape)} "
            f"(expected packed [..., in/2] and scale [..., in/32])"
        )


def dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[..., in/2] codes and [..., in/32] exponents -> [..., in] weights in ``dtype``. Exact in
    fp32 and bf16 (FP4 values have 2 significant bits; the scale is a power of two)."""
    _check(packed, scale)
    lut = torch.tensor(FP4, dtype=torch.float32, device=packed.device)
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2).long()  # low nibble first
    values = lut[codes].unflatten(-1, (scale.shape[-1], GROUP))
    exp = scale.to(torch.int32) - 127
    return torch.ldexp(values, exp.unsqueeze(-1).float()).flatten(-2).to(dtype)


def decode_reference(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The definition, element by element in float64: an E2M1 code is sign | 2 exponent bits |
    1 mantissa bit; exponent 0 is subnormal (m * 0.5), else 2^(e - 1) * (1 + m / 2). Slow: for
    checks on a few rows."""
    _check(packed, scale)
    rows_p, rows_s = packed.reshape(-1, packed.shape[-1]).tolist(), scale.reshape(-1, scale.shape[-1]).tolist()
    out = []
    for row_p, row_s in zip(rows_p, rows_s, strict=True):
        row = []
        for i, byte in enumerate(row_p):
            for code in (byte & 0x0F, byte >> 4):
                s, e, m = code >> 3, (code >> 1) & 3, code & 1
                v = m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
                row.append((-v if s else v) * 2.0 ** (row_s[(2 * i) // GROUP] - 127))
        out.append(row)
    return torch.tensor(out, dtype=torch.float64).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., in] -> (packed, scale): each group of 32 scaled so its largest magnitude fits 6,
    each element rounded to the nearest FP4 value. For tests and examples (no stochastic
    rounding, no clipping search)."""
    if w.shape[-1] % GROUP:
        raise ValueError(f"the last dimension ({w.shape[-1]}) must be a multiple of {GROUP}")
    g = w.float().unflatten(-1, (w.shape[-1] // GROUP, GROUP))
    amax = g.abs().amax(-1, keepdim=True).clamp_min(2.0**-126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = g / torch.exp2(exp)
    lut = torch.tensor(FP4, dtype=torch.float32)
    codes = (scaled.unsqueeze(-1) - lut).abs().argmin(-1).flatten(-2).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, (exp.squeeze(-1) + 127).to(torch.uint8)

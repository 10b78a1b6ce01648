"""MXFP4, the format gpt-oss's released checkpoints store their experts' kernels in, dequantised to
float32 in NumPy at import.

A tensor HF holds as (E, C, R) is stored as "<name>_blocks", uint8 (E, R, C / 32, 16), and
"<name>_scales", uint8 (E, R, C / 32): each byte two FP4 (e2m1) codes, the low nibble first, each
group of 32 values sharing the power of two 2 ** (scale - 127). transformers' `convert_moe_packed_tensors`
decodes it to (E, R, C) and transposes the last two axes; `dequantize` computes the same values (every
FP4 value times a power of two is exact in float32, so no rounding is involved).
"""

from __future__ import annotations

from typing import Any

import numpy as np

# The 16 FP4 (e2m1) values by code: sign bit, two exponent bits, one mantissa bit.
FP4_VALUES = np.array(
    [+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)


def packed_shapes(hf_shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(blocks shape, scales shape) of a tensor HF holds as `hf_shape` (E, C, R), C a multiple of 32."""
    e, c, r = hf_shape
    return (e, r, c // 32, 16), (e, r, c // 32)


def dequantize_expert(blocks: Any, scales: Any) -> np.ndarray:
    """One expert: blocks uint8 (R, G, 16), scales uint8 (R, G) -> float32 (G * 32, R), HF's layout."""
    blocks = np.asarray(blocks, np.uint8)
    r, g, b = blocks.shape
    values = np.empty((r, g, 2 * b), np.float32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    exponents = np.asarray(scales, np.int32) - 127
    values = np.ldexp(values, exponents[:, :, None])
    return np.ascontiguousarray(values.reshape(r, g * 2 * b).T)


def dequantize(blocks: Any, scales: Any, out: np.ndarray | None = None) -> np.ndarray:
    """blocks uint8 (E, R, G, 16), scales uint8 (E, R, G) -> float32 (E, G * 32, R), one expert at a
    time (memory-mapped inputs are read expert by expert), written into `out` where given."""
    e, r, g, _ = np.shape(blocks)
    if np.shape(scales) != (e, r, g):
        raise ValueError(f"MXFP4 blocks {np.shape(blocks)} and scales {np.shape(scales)} do not pair up.")
    out = np.empty((e, g * 32, r), np.float32) if out is None else out
    for i in range(e):
        out[i] = dequantize_expert(blocks[i], scales[i])
    return out

"""Fused optimizer updates in host RAM: one pass over memory per parameter.

XLA:CPU compiles an optax update into several loop fusions (new first moment, new second moment, new
parameter, compute-dtype copy), each a full pass over memory: ~42 bytes per parameter for AdamW, at
~2 G params/s on the 16-core GPU host (measured, BENCHMARKS.md). The update is memory-bound, so the
kernels here read each parameter, gradient and moment once and write each result once (28 bytes per
parameter for AdamW with float32 moments, 20 with bfloat16 moments), as `torch.optim.AdamW(fused=True)`
does. They are compiled by numba (a wheel; no compiler at install time) and run on chunks of ~1M
parameters from a pool of threads, without the GIL.

They reproduce optax's arithmetic in float32 and in optax's order of operations, for the optimizers
`jaxzero.optim.build_optimizer` builds (AdamW/Adam, Lion, SGD with or without momentum; moments in
float32 or bfloat16). They are tested against optax's own update (tests/test_host_kernels.py). Any
other transformation keeps running as optax on XLA:CPU.

The kernels update the host arrays *in place*: they write through a NumPy view of the CPU backend's
buffer (`writable_view`). That is what the update's buffer donation did before; the step consumes
its input state either way, and nothing else reads these buffers while a step runs.

bfloat16 is handled as its 16 bits (uint16): widening is a shift, narrowing rounds to nearest even as
XLA's convert does. Each kernel runs over cache-sized tiles (widen, update in float32, narrow), so
every stage vectorises and memory is still read and written once.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numba
import numpy as np
from numba import types
from numba.extending import overload

from jaxzero.config import OptimizerConfig

CHUNK = 1 << 20  # parameters per kernel call: enough to amortise the call, small enough to balance threads

_F32_ONE = np.float32(1.0)

# -- bfloat16 as bits ------------------------------------------------------------------------------
# The kernels work on tiles of TILE elements that stay in cache: bfloat16 inputs are widened into
# float32 tiles, the update runs on float32, and results are narrowed back, each stage a simple loop
# over arrays that LLVM vectorises (per-element bit casts inside the main loop would stop that).

TILE = 2048


def _widen(src, dst):  # dst[:n] = src as float32 (bfloat16 given as uint16 bits)
    raise NotImplementedError  # numba-only; see the overload


def _narrow(src, dst):  # dst[:] = float32 src, rounded to nearest even if dst holds bfloat16 bits
    raise NotImplementedError


@overload(_widen, inline="always")
def _widen_impl(src, dst):
    if src.dtype == types.uint16:

        def widen_bf16(src, dst):
            bits = dst.view(np.uint32)
            for j in range(src.shape[0]):
                bits[j] = np.uint32(src[j]) << np.uint32(16)

        return widen_bf16

    def widen(src, dst):
        for j in range(src.shape[0]):
            dst[j] = src[j]

    return widen


@overload(_narrow, inline="always")
def _narrow_impl(src, dst):
    if dst.dtype == types.uint16:

        def narrow_bf16(src, dst):
            bits = src.view(np.uint32)
            for j in range(dst.shape[0]):
                u = bits[j]
                rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
                nan = (u >> np.uint32(16)) | np.uint32(0x40)  # a NaN stays NaN (quiet), never rounds to inf
                is_nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
                dst[j] = np.uint16(nan if is_nan else rounded)

        return narrow_bf16

    def narrow(src, dst):
        for j in range(dst.shape[0]):
            dst[j] = src[j]

    return narrow


# -- kernels: one chunk, in place ------------------------------------------------------------------
# Scalars arrive as float32 so that every operation stays in float32, as in XLA.

_jit = numba.njit(nogil=True, error_model="numpy", cache=False)


@_jit
def _adam(p, m, v, g, w, gmul, b1, b2, eps, bc1, bc2, neg_lr, wd):  # pragma: no cover - numba
    one = np.float32(1.0)
    gt, mt, vt = np.empty(TILE, np.float32), np.empty(TILE, np.float32), np.empty(TILE, np.float32)
    for lo in range(0, p.shape[0], TILE):
        hi = min(lo + TILE, p.shape[0])
        k = hi - lo
        _widen(g[lo:hi], gt)
        _widen(m[lo:hi], mt)
        _widen(v[lo:hi], vt)
        for j in range(k):
            gj = gt[j] * gmul
            mj = (one - b1) * gj + b1 * mt[j]
            vj = (one - b2) * (gj * gj) + b2 * vt[j]
            pj = p[lo + j]
            u = (mj / bc1) / (np.sqrt(vj / bc2) + eps)
            u = u + wd * pj
            p[lo + j] = pj + u * neg_lr
            mt[j] = mj
            vt[j] = vj
        _narrow(mt[:k], m[lo:hi])
        _narrow(vt[:k], v[lo:hi])
        _narrow(p[lo:hi], w[lo:hi])


@_jit
def _lion(p, m, g, w, gmul, b1, b2, neg_lr, wd):  # pragma: no cover - numba
    one = np.float32(1.0)
    gt, mt = np.empty(TILE, np.float32), np.empty(TILE, np.float32)
    for lo in range(0, p.shape[0], TILE):
        hi = min(lo + TILE, p.shape[0])
        k = hi - lo
        _widen(g[lo:hi], gt)
        _widen(m[lo:hi], mt)
        for j in range(k):
            gj = gt[j] * gmul
            mj = mt[j]
            u = np.sign((one - b1) * gj + b1 * mj)
            pj = p[lo + j]
            u = u + wd * pj
            p[lo + j] = pj + u * neg_lr
            mt[j] = (one - b2) * gj + b2 * mj
        _narrow(mt[:k], m[lo:hi])
        _narrow(p[lo:hi], w[lo:hi])


@_jit
def _sgd_momentum(p, t, g, w, gmul, momentum, neg_lr, wd):  # pragma: no cover - numba
    gt, tt = np.empty(TILE, np.float32), np.empty(TILE, np.float32)
    for lo in range(0, p.shape[0], TILE):
        hi = min(lo + TILE, p.shape[0])
        k = hi - lo
        _widen(g[lo:hi], gt)
        _widen(t[lo:hi], tt)
        for j in range(k):
            pj = p[lo + j]
            gj = gt[j] * gmul + wd * pj
            tj = gj + momentum * tt[j]
            p[lo + j] = pj + tj * neg_lr
            tt[j] = tj
        _narrow(tt[:k], t[lo:hi])
        _narrow(p[lo:hi], w[lo:hi])


@_jit
def _sgd(p, g, w, gmul, neg_lr, wd):  # pragma: no cover - numba
    gt = np.empty(TILE, np.float32)
    for lo in range(0, p.shape[0], TILE):
        hi = min(lo + TILE, p.shape[0])
        _widen(g[lo:hi], gt)
        for j in range(hi - lo):
            pj = p[lo + j]
            gj = gt[j] * gmul + wd * pj
            p[lo + j] = pj + gj * neg_lr
        _narrow(p[lo:hi], w[lo:hi])


# -- views -----------------------------------------------------------------------------------------


def _bits(dtype: np.dtype) -> np.dtype:
    """The dtype a kernel sees: bfloat16 as its bits."""
    return np.dtype(np.uint16) if dtype == jnp.bfloat16 else np.dtype(dtype)


def writable_view(x: jax.Array) -> np.ndarray:
    """A flat, writable NumPy view of a CPU-backend array's buffer (bfloat16 as uint16). Writes are
    seen by the array: the caller must own `x` and nothing may read it concurrently. Waits for `x`
    (a host sync)."""
    buf = (ctypes.c_byte * x.nbytes).from_address(x.unsafe_buffer_pointer())
    return np.frombuffer(buf, dtype=_bits(x.dtype))


def readable_view(x: np.ndarray) -> np.ndarray:
    """A flat view of a host NumPy array (bfloat16 as uint16)."""
    return x.reshape(-1).view(_bits(x.dtype))


# -- which optimizers --------------------------------------------------------------------------------


@dataclass(frozen=True)
class FusedRule:
    """The fused form of `build_optimizer(cfg, clip=False, mask=...)`'s update for one unit."""

    name: str  # adamw | adam | lion | sgd
    b1: float
    b2: float
    eps: float
    weight_decay: float
    momentum: float

    @staticmethod
    def of(
        cfg: OptimizerConfig, compute_dtype: jnp.dtype, grad_dtypes: Sequence[jnp.dtype]
    ) -> FusedRule | None:
        """The rule for `cfg`, or None where the fused kernels do not cover it (that update then runs
        as optax on XLA:CPU): weights and gradients must be float32 or bfloat16."""
        ok = {np.dtype(jnp.float32), np.dtype(jnp.bfloat16)}
        if np.dtype(compute_dtype) not in ok or any(np.dtype(d) not in ok for d in grad_dtypes):
            return None
        if cfg.name not in ("adamw", "adam", "lion", "sgd"):
            return None
        return FusedRule(cfg.name, cfg.b1, cfg.b2, cfg.eps, cfg.weight_decay, cfg.momentum)

    def moments(self) -> tuple[str, ...]:
        """Names of the optax state fields that hold per-parameter moments, in kernel order."""
        if self.name in ("adamw", "adam"):
            return ("mu", "nu")
        if self.name == "lion":
            return ("mu",)
        return ("trace",) if self.momentum else ()

    def kernel(self, count: int, lr: float, gmul: float) -> Callable[..., None]:
        """A function (p, *moments, g, w, decays) -> None updating one chunk in place, for the update
        number `count` (0-based: updates already applied) at learning rate `lr`; gradients are
        multiplied by `gmul` (averaging, loss scale and clipping in one factor)."""
        f32 = np.float32
        gmul, neg_lr = f32(gmul), -f32(lr)
        if self.name in ("adamw", "adam"):
            b1, b2, eps = f32(self.b1), f32(self.b2), f32(self.eps)
            t = f32(count + 1)  # optax: bias correction with the incremented count, 1 - b**t in float32
            bc1, bc2 = _F32_ONE - b1**t, _F32_ONE - b2**t

            def adam(p, m, v, g, w, wd):
                _adam(p, m, v, g, w, gmul, b1, b2, eps, bc1, bc2, neg_lr, f32(wd))

            return adam
        if self.name == "lion":
            b1, b2 = f32(self.b1), f32(self.b2)
            return lambda p, m, g, w, wd: _lion(p, m, g, w, gmul, b1, b2, neg_lr, f32(wd))
        if self.momentum:
            mom = f32(self.momentum)
            return lambda p, t, g, w, wd: _sgd_momentum(p, t, g, w, gmul, mom, neg_lr, f32(wd))
        return lambda p, g, w, wd: _sgd(p, g, w, gmul, neg_lr, f32(wd))


def chunks(n: int, size: int = CHUNK) -> list[slice]:
    """[0, n) cut into slices of at most `size`."""
    return [slice(lo, min(lo + size, n)) for lo in range(0, n, size)]

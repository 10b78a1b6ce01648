"""Attention with sinks (gpt-oss): each query head's softmax has one more logit, a learned per-head
scalar that takes weight and reads no value.

    out[b, i, n] = sum_j p[b, n, i, j] v[b, j, n // g],
    p[b, n, i, :] = softmax([scale * q[b, i, n] . k[b, j, n // g] for the keys j query i reads; sink[n]])[:-1]

Three exact ways to compute it, one module per concern of the block's attention:

- `sink_attention`: XLA, float32 scores over every key (any mask; the reference, and decoding's).
- `banded_sink_attention`: XLA over blocks of `window` queries, each reading its own and the previous
  block's keys: a local layer's (B, N, S, 2W) scores instead of (B, N, S, S).
- `cudnn_sink_attention`: `jax.nn.dot_product_attention` (cuDNN's causal kernel on the GPU) over keys
  with the sink prepended. The sink's logit rides in two extra head dimensions: each query head
  carries its sink over `scale` (as a bfloat16 pair, hi + lo), the prepended key carries ones there
  and every other key zeros, so the prepended key scores exactly `sink[n]` for every query of head n
  and reads a zero value; a dead key beside it (a third extra dimension scores it far below any
  other) keeps the length even, as jax's cuDNN attention needs in training. Zero queries in front
  keep the causal mask square (query i + 2 reads keys 0 .. i + 2: the sink, the dead key and keys
  0 .. i). Gradients, the sinks' too, are the kernel's.

`windowed_sink_attention` picks between the last two per layer on the device (`lax.switch` on the
layer's traced window), so one compiled block serves local and global layers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxzero.models.layers import AttentionImpl

# Head dimensions are padded to this multiple for cuDNN (its rule for bfloat16 flash attention).
_HEAD_MULTIPLE = 8
# Keys in front of the sequence: the sink's and a dead one, so that the length stays even (jax's
# cuDNN attention refuses an odd one in training). The dead key scores -_DEAD * scale: exp() is 0.
_FRONT = 2
_DEAD = 2.0**20


def sink_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, sinks: jax.Array, mask: jax.Array, scale: float
) -> jax.Array:
    """Attention whose softmax has one more logit per head, `sinks`, that takes weight and reads no
    value: q (B, T, N, H), k and v (B, L, K, H) in one dtype, sinks (N,), mask bool (B or 1, T, L)
    (True: the query reads the key) -> (B, T, N, H) in q's dtype. Query head n reads key/value head
    n // (N / K) (HF's `repeat_kv`); scores and softmax in float32."""
    b, t, n, hd = q.shape
    kv = k.shape[2]
    g = n // kv
    scores = jnp.einsum(
        "btkgh,blkh->bkgtl", q.reshape(b, t, kv, g, hd), k, preferred_element_type=jnp.float32
    ) * jnp.float32(scale)
    allowed = mask[:, None, None, :, :]  # (B or 1, 1, 1, T, L)
    probs = _probs(scores, allowed, sinks.reshape(1, kv, g, 1, 1))
    o = jnp.einsum("bkgtl,blkh->btkgh", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(b, t, n, hd).astype(q.dtype)


def _probs(scores: jax.Array, allowed: jax.Array, sink: jax.Array) -> jax.Array:
    """The softmax of float32 `scores` (keys last) over the keys `allowed` (bool, broadcast to them)
    and one more logit, `sink` (broadcast to scores[..., :1]), whose own weight is dropped."""
    scores = jnp.where(allowed, scores, jnp.finfo(jnp.float32).min)
    sink = jnp.broadcast_to(sink.astype(jnp.float32), (*scores.shape[:-1], 1))
    return jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]


def window_mask(q_pos: jax.Array, k_pos: jax.Array, window: jax.Array | int) -> jax.Array:
    """bool (T, L): key j at or before query i and less than `window` positions behind it."""
    offset = q_pos[:, None] - k_pos[None, :]
    return (offset >= 0) & (offset < window)


def banded_sink_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, sinks: jax.Array, window: int, scale: float
) -> jax.Array:
    """`sink_attention` over a causal sliding window of `window` keys (static), self-attention:
    q (B, S, N, H), k and v (B, S, K, H) -> (B, S, N, H) in q's dtype. The sequence is cut into blocks
    of `window` queries (the last padded); each block reads its own and the previous block's keys,
    which hold every key of its queries' windows, so the scores are (B, N, S, 2 * window) float32."""
    b, s, n, hd = q.shape
    kv = k.shape[2]
    g, c = n // kv, window
    blocks = -(-s // c)
    pad = blocks * c - s

    def blocked(x: jax.Array) -> jax.Array:  # (B, S, ., H) -> (B, blocks, c, ., H)
        x = jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))
        return x.reshape(b, blocks, c, *x.shape[2:])

    def with_previous(x: jax.Array) -> jax.Array:  # (B, blocks, c, K, H) -> (B, blocks, 2c, K, H)
        before = jnp.pad(x, ((0, 0), (1, 0), (0, 0), (0, 0), (0, 0)))[:, :-1]
        return jnp.concatenate([before, x], axis=2)

    qb = blocked(q).reshape(b, blocks, c, kv, g, hd)
    kb, vb = with_previous(blocked(k)), with_previous(blocked(v))
    scores = jnp.einsum("bncKgh,bnlKh->bnKgcl", qb, kb, preferred_element_type=jnp.float32)
    scores = scores * jnp.float32(scale)
    # Query r of block m is at m*c + r, key l of its 2c at (m-1)*c + l: offset c + r - l; block 0's
    # first c keys are padding before the sequence.
    r, col = jnp.arange(c)[:, None], jnp.arange(2 * c)[None, :]
    offset = c + r - col
    allowed = (offset >= 0) & (offset < window)
    allowed = allowed[None, :, :] & ((jnp.arange(blocks)[:, None, None] > 0) | (col >= c)[None])
    probs = _probs(scores, allowed[None, :, None, None], sinks.reshape(1, 1, kv, g, 1, 1))
    o = jnp.einsum("bnKgcl,bnlKh->bncKgh", probs.astype(v.dtype), vb, preferred_element_type=jnp.float32)
    return o.reshape(b, blocks * c, n, hd)[:, :s].astype(q.dtype)


def augmented_head_dim(head_dim: int) -> int:
    """The head dimension `cudnn_sink_attention` hands the kernel: three more (the sink's two, the
    dead key's one), rounded up to a multiple of 8."""
    return -(-(head_dim + 3) // _HEAD_MULTIPLE) * _HEAD_MULTIPLE


def cudnn_sink_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, sinks: jax.Array, scale: float, impl: AttentionImpl
) -> jax.Array:
    """Causal `sink_attention` through `jax.nn.dot_product_attention(implementation=impl)`:
    q (B, S, N, H), k and v (B, S, K, H) in one dtype, sinks (N,) -> (B, S, N, H) in q's dtype. The
    kernel sees (B, S + 2, ., `augmented_head_dim(H)`) (the module docstring says how); with
    impl="xla" it is the same computation in XLA, which the CPU tests check."""
    b, s, n, hd = q.shape
    kv = k.shape[2]
    dtype = q.dtype
    extra = augmented_head_dim(hd) - hd
    logit = sinks.astype(jnp.float32) / jnp.float32(scale)
    hi = logit.astype(dtype).astype(jnp.float32)
    lo = logit - hi  # hi + lo: the logit to ~16 bits, whatever `scale` is
    # Extra dims: [hi, lo] meet the sink key's ones; the third meets the dead key's -_DEAD.
    parts = jnp.zeros((n, extra), jnp.float32).at[:, 0].set(hi).at[:, 1].set(lo).at[:, 2].set(1.0)
    # Broadcast in float32, then round: the sinks' gradient sums over (B, S) in float32.
    q_extra = jnp.broadcast_to(parts, (b, s, n, extra)).astype(dtype)
    front = jnp.zeros((b, _FRONT, kv, hd + extra), dtype)
    front = front.at[:, 0, :, hd : hd + 2].set(1).at[:, 1, :, hd + 2].set(-_DEAD)
    q_aug = jnp.concatenate([q, q_extra], axis=-1)
    k_aug = jnp.concatenate([k, jnp.zeros((b, s, kv, extra), dtype)], axis=-1)
    v_aug = jnp.pad(v, ((0, 0), (_FRONT, 0), (0, 0), (0, extra)))  # the front keys read zeros
    q_aug = jnp.pad(q_aug, ((0, 0), (_FRONT, 0), (0, 0), (0, 0)))  # zero queries in front
    k_aug = jnp.concatenate([front, k_aug], axis=1)
    out = jax.nn.dot_product_attention(q_aug, k_aug, v_aug, scale=scale, is_causal=True, implementation=impl)
    return out[:, _FRONT:, :, :hd].astype(dtype)


def windowed_sink_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    sinks: jax.Array,
    *,
    window: jax.Array,
    local_window: int,
    scale: float,
    impl: AttentionImpl,
) -> jax.Array:
    """Causal `sink_attention` over the keys less than `window` (int32 scalar, traced) behind each
    query, self-attention (q (B, S, N, H), k and v (B, S, K, H)), where `window` is the model's
    `local_window` (static) or spans the sequence, as its layers' inputs are: `banded_sink_attention`
    for the one, `cudnn_sink_attention` for the other, chosen on the device (`lax.switch`); only the
    latter where `local_window` spans the sequence (a model without local layers, or a short run).
    No branch for other windows: a switch holds its largest branch's temporaries, and the dense
    mask's (B, N, S, S) float32 scores are what this path exists to avoid."""
    if local_window >= q.shape[1]:  # every layer reads every earlier key (no window, or a short run)
        return cudnn_sink_attention(q, k, v, sinks, scale, impl)
    branches = [
        lambda q, k, v, sinks: banded_sink_attention(q, k, v, sinks, local_window, scale),
        lambda q, k, v, sinks: cudnn_sink_attention(q, k, v, sinks, scale, impl),
    ]
    return jax.lax.switch(jnp.where(window == local_window, 0, 1), branches, q, k, v, sinks)

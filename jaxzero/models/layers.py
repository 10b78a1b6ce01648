"""Building blocks shared by the model families: casting, init, norms, rotary embeddings, attention.

Everything here is a pure function of arrays. Parameters are plain nested dicts whose leaves follow the
Flax naming convention, which the optimizer and the checkpoint/HF-conversion code rely on:

    "kernel"     a matmul weight stored (in, out), like `flax.linen.Dense` (HF Linear stores (out, in))
    "embedding"  a lookup table (rows, D)
    "scale"      a norm's multiplicative weight (D,)
    "bias"       an additive bias (out,)

Numerics: activations flow in the compute dtype (bfloat16 or float32); norm statistics, softmax and
the rotary rotation are computed in float32 and cast back, and logits leave the head in float32.
JAX runs with `jax_numpy_rank_promotion="raise"` in the tests, so every broadcast here is explicit.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax.core import unfreeze
from jax.extend.backend import get_backend

from jaxzero.config import ConfigError, ModelConfig
from jaxzero.config.checks import validate_model

COMPUTE_DTYPES: dict[str, jnp.dtype] = {
    "bfloat16": jnp.dtype(jnp.bfloat16),
    "float32": jnp.dtype(jnp.float32),
    "float16": jnp.dtype(jnp.float16),
}


def compute_dtype(config: ModelConfig) -> jnp.dtype:
    """The matmul/activation dtype named by `config.compute_dtype`."""
    try:
        return COMPUTE_DTYPES[config.compute_dtype]
    except KeyError:
        raise ConfigError(
            f"model.compute_dtype={config.compute_dtype!r} is not one of {list(COMPUTE_DTYPES)}."
        ) from None


def cast_tree(tree: Any, dtype: jnp.dtype) -> Any:
    """Cast every floating leaf of `tree` to `dtype`; leaves already of that dtype are returned as is.

    Skipping same-dtype leaves keeps the call free when the offload engine already streams weights in
    the compute dtype, and keeps the traced graph free of no-op converts.
    """

    def cast(x: jax.Array) -> jax.Array:
        if x.dtype == dtype or not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        return x.astype(dtype)

    return jax.tree.map(cast, tree)


def check_shape(config: ModelConfig, family: str) -> None:
    """Raise ConfigError if `config` cannot describe a `family` transformer.

    `jaxzero.config.checks.validate` checks the same rules for whole runs; models check them again because
    they are also built directly (tests, conversion scripts) without a TrainConfig.
    """
    if config.family != family:
        raise ConfigError(f"model.family={config.family!r} cannot build a {family} model.")
    validate_model(config)
    compute_dtype(config)


# ---------------------------------------------------------------------------------------------------
# Initialization
# ---------------------------------------------------------------------------------------------------


# Tensors are drawn one by one, each from its own key: one flat draw per block, sliced, compiles slower
# on GPU and on XLA:CPU keeps every draw's temporaries live at once. XLA:GPU unrolls every threefry draw
# unless `jax_threefry_gpu_kernel_lowering` is on (same values, far shorter compiles of a large init);
# that flag is process-wide, so the program sets it (`jaxzero.cli.train.main`), not this library.


def init_block_module(block: Any, config: ModelConfig, key: jax.Array) -> dict[str, Any]:
    """The float32 parameters of a block module (`LlamaBlock`, `GPT2Block`) from its own initializers;
    shapes are inferred from a (1, 1, D) input without running the block."""
    x = jax.ShapeDtypeStruct((1, 1, config.hidden_size), compute_dtype(config))
    return unfreeze(block.lazy_init(key, x)["params"])


def split_init_keys(key: jax.Array, num_layers: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Split a model key into (embed key, `num_layers` block keys, head key).

    This is the one place that fixes how `init` consumes randomness: block `i` of `init(key)` is
    `init_block(split_init_keys(key, num_layers)[1][i])`, so an engine that initializes one layer at a time
    (e.g. straight into host memory) reproduces `init(key)` exactly. Works for raw `PRNGKey` arrays
    (block keys shaped (num_layers, 2) uint32) and typed `jax.random.key` arrays (block keys (num_layers,)).
    """
    k_embed, k_blocks, k_head = jax.random.split(key, 3)
    return k_embed, jax.random.split(k_blocks, num_layers), k_head


def normal(key: jax.Array, shape: Sequence[int], std: float) -> jax.Array:
    """float32 samples of Normal(0, std**2) with the given shape."""
    return _normal(key, tuple(shape), float(std))


@functools.partial(jax.jit, static_argnames=("shape", "std"))
def _normal(key: jax.Array, shape: tuple[int, ...], std: float) -> jax.Array:
    # Jitted as one unit so that `init` gives bit-identical values eagerly and under an outer jit. XLA
    # folds `sqrt(2) * erfinv(u) * std` into `erfinv(u) * (sqrt(2) * std)` when both multiplies are in
    # one computation; with the scaling inside this function that holds on both paths, whereas an eager
    # multiply outside it would round differently (by one ulp) from the fused one under jit.
    return jax.random.normal(key, shape, jnp.float32) * jnp.float32(std)


def ones(shape: Sequence[int]) -> jax.Array:
    """float32 ones (norm scales)."""
    return jnp.ones(tuple(shape), jnp.float32)


def zeros(shape: Sequence[int]) -> jax.Array:
    """float32 zeros (biases)."""
    return jnp.zeros(tuple(shape), jnp.float32)


# ---------------------------------------------------------------------------------------------------
# Linear algebra
# ---------------------------------------------------------------------------------------------------


def _lead(v: jax.Array, ndim: int) -> jax.Array:
    """Reshape a (F,) vector to (1, ..., 1, F) with `ndim` dims: an explicit, rank-preserving broadcast."""
    return v.reshape((1,) * (ndim - 1) + v.shape)


def dense(x: jax.Array, kernel: jax.Array, bias: jax.Array | None = None) -> jax.Array:
    """x (..., in) @ kernel (in, out) [+ bias (out,)] -> (..., out), in the dtype of x and kernel.

    Both operands are expected in the compute dtype already. On GPU a bf16 x bf16 dot accumulates in
    float32 inside cuBLAS, so no `preferred_element_type` is needed (and asking for f32 output here
    would make the backward pass run mixed f32 x bf16 GEMMs).
    """
    y = jnp.matmul(x, kernel)
    if bias is not None:
        y = y + _lead(bias, y.ndim)
    return y


@jax.custom_vjp
def logits_matmul(h: jax.Array, w: jax.Array) -> jax.Array:
    """Logits h (B, S, D) @ w (D, V) -> (B, S, V) float32, with a compute-dtype backward pass.

    The forward GEMM writes float32 directly (no bf16 rounding of logits before the softmax/CE). Plain
    autodiff of a `preferred_element_type=float32` dot would then run both backward GEMMs with a float32
    cotangent against bf16 operands, i.e. as slow float32 GEMMs on the largest matmul of small models;
    instead the custom VJP rounds the cotangent to the operands' dtype (what every bf16 trainer does) and
    runs the backward GEMMs in that dtype with float32 accumulation. In float32 compute it is exactly
    the ordinary gradient.
    """
    return jnp.einsum("bsd,dv->bsv", h, w, preferred_element_type=jnp.float32)


def _logits_matmul_fwd(h: jax.Array, w: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return logits_matmul(h, w), (h, w)


def _logits_matmul_bwd(res: tuple[jax.Array, jax.Array], g: jax.Array) -> tuple[jax.Array, jax.Array]:
    h, w = res
    g = g.astype(h.dtype)
    dh = jnp.einsum("bsv,dv->bsd", g, w.astype(h.dtype), preferred_element_type=jnp.float32)
    dw = jnp.einsum("bsv,bsd->dv", g, h, preferred_element_type=jnp.float32)
    return dh.astype(h.dtype), dw.astype(w.dtype)


logits_matmul.defvjp(_logits_matmul_fwd, _logits_matmul_bwd)


# ---------------------------------------------------------------------------------------------------
# Normalization
# ---------------------------------------------------------------------------------------------------


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis: x / sqrt(mean(x^2) + eps) * scale.

    x (..., D) in any float dtype, scale (D,). Statistics and the product are computed in float32 (a
    bf16 mean of squares over thousands of features loses most of its mantissa), then cast back to
    x.dtype once.
    """
    x32 = x.astype(jnp.float32)
    var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    y = x32 * jax.lax.rsqrt(var + jnp.float32(eps))
    return (y * _lead(scale.astype(jnp.float32), y.ndim)).astype(x.dtype)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """LayerNorm over the last axis: (x - mean) / sqrt(var + eps) * scale + bias.

    x (..., D) in any float dtype, scale and bias (D,). Computed in float32, cast back to x.dtype.
    """
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    centered = x32 - mean
    var = jnp.mean(jnp.square(centered), axis=-1, keepdims=True)
    y = centered * jax.lax.rsqrt(var + jnp.float32(eps))
    y = y * _lead(scale.astype(jnp.float32), y.ndim) + _lead(bias.astype(jnp.float32), y.ndim)
    return y.astype(x.dtype)


# ---------------------------------------------------------------------------------------------------
# Rotary position embeddings (Hugging Face "rotate half" convention)
# ---------------------------------------------------------------------------------------------------


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """The (R / 2,) float64 rotary frequencies of `config`, as HF's rope init functions make them, R =
    int(head_dim x partial_rotary_factor) the rotated dims of each head (all of them but for Phi-3's
    partial rotary).

    default: 1 / theta^(arange(0, R, 2) / R). linear: those / rope_factor. llama3 (Llama 3.1+,
    `_compute_llama3_parameters`): wavelengths 2*pi/f above rope_original_max_len / low_freq_factor
    are divided by rope_factor, those below rope_original_max_len / high_freq_factor kept, and the
    band between interpolated smoothly. yarn (`_compute_yarn_parameters`): a linear ramp over the
    dimensions between the rope_beta_fast and rope_beta_slow rotations of rope_original_max_len blends
    inv / rope_factor into inv; it also scales cos and sin (`rope_attention_factor`).
    """
    h = int(config.head_dim * config.partial_rotary_factor)
    inv = 1.0 / (config.rope_theta ** (np.arange(0, h, 2, dtype=np.float64) / h))
    if config.rope_type == "linear":
        return inv / config.rope_factor
    if config.rope_type == "yarn":

        def dim(rotations: float) -> float:  # the dimension that turns `rotations` times in the context
            old = config.rope_original_max_len
            return h * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(config.rope_theta))

        low, high = dim(config.rope_beta_fast), dim(config.rope_beta_slow)
        if config.rope_truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, h - 1)
        high = high + 0.001 if low == high else high  # transformers' guard against a zero-width ramp
        keep = 1 - np.clip((np.arange(h // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        return inv / config.rope_factor * (1 - keep) + inv * keep
    if config.rope_type == "llama3":
        factor, lo, hi = config.rope_factor, config.rope_low_freq_factor, config.rope_high_freq_factor
        old = config.rope_original_max_len
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        return np.where(medium, smoothed, scaled)
    return inv


def rope_attention_factor(config: ModelConfig) -> float:
    """The factor yarn multiplies cos and sin by (transformers' `attention_factor`):
    `rope_attention_factor`, or 0.1 ln(rope_factor) + 1 where it is 0 (1 for a factor <= 1); 1 for
    every other rope type."""
    if config.rope_type != "yarn":
        return 1.0
    if config.rope_attention_factor:
        return config.rope_attention_factor
    return 1.0 if config.rope_factor <= 1 else 0.1 * math.log(config.rope_factor) + 1.0


def rope_cos_sin(seq_len: int, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables, each (seq_len, R) float32, for positions 0 .. seq_len-1 (R: twice
    `inv_freq`'s length, the rotated dims of a head).

    Matches HF's rotary embedding for the frequencies `inv_freq` (`rope_inv_freq`): freqs = pos (x)
    inv_freq, emb = concat([freqs, freqs]). `inv_freq` is computed on the host in float64 and rounded
    once to float32 (HF computes it in float32; the two agree to an ulp); the tables depend only on
    static shapes, so under jit they are constants folded into the program.
    """
    inv = jnp.asarray(inv_freq, jnp.float32)
    pos = jnp.arange(seq_len, dtype=jnp.float32)
    freqs = pos[:, None] * inv[None, :]  # (S, H/2)
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # (S, H)
    return jnp.cos(emb), jnp.sin(emb)


def rotate_half(x: jax.Array) -> jax.Array:
    """(x1, x2) -> (-x2, x1) over the halves of the last axis."""
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x (B, S, heads, H) by position: x * cos + rotate_half(x) * sin, cos/sin (S, R) float32.
    With R < H (partial rotary) only the first R dims of each head rotate, the rest pass unchanged
    (HF's `apply_rotary_pos_emb`).

    The rotation is done in float32 and cast back once: at long contexts the high-frequency pairs
    need more than bf16's 8 bits of mantissa to keep relative positions distinguishable.
    """
    x32 = x.astype(jnp.float32)
    r = cos.shape[-1]
    c = cos[None, :, None, :]
    s = sin[None, :, None, :]
    if r < x.shape[-1]:
        turned = x32[..., :r] * c + rotate_half(x32[..., :r]) * s
        return jnp.concatenate([turned, x32[..., r:]], axis=-1).astype(x.dtype)
    return (x32 * c + rotate_half(x32) * s).astype(x.dtype)


# ---------------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------------

AttentionImpl = Literal["xla", "cudnn"]


def cuda_backend() -> tuple[bool, tuple[int, int] | None]:
    """(default backend is CUDA, compute capability of device 0 or None)."""
    if jax.default_backend() != "gpu":
        return False, None
    # ROCm also reports the "gpu" backend; cuDNN exists only on CUDA (the check JAX's own cuDNN
    # attention uses).
    if "cuda" not in get_backend().platform_version.lower():
        return False, None
    cc = getattr(jax.devices()[0], "compute_capability", None)
    try:
        major, minor = (int(p) for p in str(cc).split(".")[:2])
    except ValueError:
        return True, None
    return True, (major, minor)


def _cudnn_unsupported_reason(dtype: jnp.dtype, head_dim: int) -> str | None:
    """Why cuDNN flash attention cannot run here, or None if it can.

    Mirrors the checks of jax._src.cudnn.fused_attention_stablehlo.check_is_flash_attention for the
    configuration we use (causal, no bias, no padding): bf16/fp16 inputs, head_dim a multiple of 8 and
    at most 128 (256 on Hopper and later).
    """
    is_cuda, cc = cuda_backend()
    if not is_cuda:
        return f"the default JAX backend is {jax.default_backend()!r}, not a CUDA GPU"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"cuDNN flash attention needs bfloat16 or float16 inputs, got {jnp.dtype(dtype).name}"
    max_head_dim = 256 if cc is not None and cc >= (9, 0) else 128
    if head_dim % 8 or head_dim > max_head_dim:
        return f"cuDNN flash attention needs head_dim a multiple of 8 and <= {max_head_dim}, got {head_dim}"
    return None


def resolve_attention_impl(requested: str, dtype: jnp.dtype, head_dim: int) -> AttentionImpl:
    """Map `ModelConfig.attention_impl` to the `implementation=` of `jax.nn.dot_product_attention`.

    "xla" -> "xla". "cudnn" -> "cudnn", raising ConfigError (rather than an opaque lowering error) when
    it cannot apply. "auto" -> "cudnn" when the default backend is a CUDA GPU, the dtype is bf16/fp16 and
    head_dim is supported, else "xla". We pick explicitly because in jax 0.10 `implementation=None`
    always means XLA (the cuDNN auto-selection is a TODO there), which on GPU materializes the full
    (B, N, S, S) float32 score tensor.
    """
    if requested == "xla":
        return "xla"
    reason = _cudnn_unsupported_reason(dtype, head_dim)
    if requested == "cudnn":
        if reason is not None:
            raise ConfigError(
                f"model.attention_impl=cudnn cannot be used: {reason}. Use model.attention_impl=auto or xla."
            )
        return "cudnn"
    if requested == "auto":
        return "cudnn" if reason is None else "xla"
    raise ConfigError(f"model.attention_impl={requested!r} is not one of ['auto', 'xla', 'cudnn'].")


def same_segment(segments: jax.Array) -> jax.Array:
    """bool (B, 1, S, S): query i and key j of a row are in one segment. segments int32 (B, S).

    The dense mask `jax.nn.dot_product_attention` takes (with `is_causal`, which adds the causal
    part): B * S * S bytes, made inside the attention's program.
    """
    return (segments[:, :, None] == segments[:, None, :])[:, None, :, :]


def packed_document_sizes(seq_len: int, num_heads: int) -> tuple[int, ...]:
    """The documents per row cuDNN's packed layout is compiled for, smallest first: 8, 64, 512, ...
    (its kernels launch work for every slot, used or not, so a micro-batch runs the smallest size that
    holds each of its rows), up to the largest whose float32 softmax statistics, (B * M, N, S), take
    no more memory than the mask of the other path would."""
    bound = max(1, min(seq_len, seq_len // (2 * num_heads)))
    sizes = [8]
    while sizes[-1] * 8 < bound:
        sizes.append(sizes[-1] * 8)
    return (*(m for m in sizes if m < bound), bound)


def packed_layout_applies(num_heads: int, num_kv_heads: int) -> bool:
    """Whether cuDNN's packed layout can run here: a Hopper or later GPU (cuDNN's rule), and a jax
    that offsets grouped-query keys by their own head count (0.11.0 used the query's) or K == N."""
    _, cc = cuda_backend()
    fixed = jax.__version_info__ >= (0, 11, 1) or num_kv_heads == num_heads
    return cc is not None and cc >= (9, 0) and fixed


def _document_index(segments: jax.Array) -> jax.Array:
    """int32 (B, S): which document of its row each token is in, 0 first, for rows whose documents are
    runs of equal segment ids."""
    starts = jnp.concatenate([jnp.ones_like(segments[:, :1], bool), segments[:, 1:] != segments[:, :-1]], 1)
    return jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1


def _packed(doc: jax.Array, max_docs: int) -> tuple[jax.Array, jax.Array]:
    """The packed layout of rows of at most `max_docs` documents (`_document_index` doc (B, S)): per
    row (B, M) int32 document lengths and (B, M + 1) int32 start offsets, -1 past its documents."""
    b = doc.shape[0]
    rows = jnp.arange(b, dtype=jnp.int32)[:, None]
    lengths = jnp.zeros((b, max_docs), jnp.int32).at[rows, doc].add(1, mode="drop")
    first = jnp.cumsum(lengths, axis=1, dtype=jnp.int32) - lengths
    used = lengths > 0
    seqlen = jnp.where(used, lengths, -1)
    offsets = jnp.concatenate([jnp.where(used, first, -1), jnp.full((b, 1), -1, jnp.int32)], axis=1)
    return seqlen, offsets


def _cudnn_within_segments(
    q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array, scale: float
) -> jax.Array:
    """cuDNN flash attention inside each document, the scores times `scale`: the packed layout of the
    smallest of `packed_document_sizes` that holds every row where it applies, else the segment mask
    as cuDNN's bias; chosen on the device (`lax.switch`)."""

    def masked(q, k, v, doc):
        mask = same_segment(doc)
        return jax.nn.dot_product_attention(
            q, k, v, mask=mask, scale=scale, is_causal=True, implementation="cudnn"
        )

    def packed(max_docs, q, k, v, doc):
        from jax._src.cudnn import fused_attention_stablehlo as cudnn  # the packed layout: not in jax.nn

        seqlen, offsets = _packed(doc, max_docs)
        return cudnn.dot_product_attention(
            q,
            k,
            v,
            q_seqlen=seqlen,
            kv_seqlen=seqlen,
            q_offsets=offsets,
            kv_offsets=offsets,
            scale=scale,
            mask_type=cudnn.MaskType.PADDING_CAUSAL,
        )

    doc = _document_index(segments)
    if not packed_layout_applies(q.shape[2], k.shape[2]):
        return masked(q, k, v, doc)
    sizes = packed_document_sizes(q.shape[1], q.shape[2])
    branches = [functools.partial(packed, m) for m in sizes] + [masked]
    most = jnp.max(doc[:, -1]) + 1  # documents in the fullest row
    return jax.lax.switch(jnp.sum(most > jnp.asarray(sizes)), branches, q, k, v, doc)


def causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    requested_impl: str,
    segments: jax.Array | None = None,
    *,
    window: jax.Array | None = None,
    local_window: int | None = None,
    scale: float | None = None,
) -> jax.Array:
    """Causal scaled dot-product attention with grouped-query heads, optionally within segments.

    q (B, S, N, H), k and v (B, S, K, H), all in one dtype, N a multiple of K -> (B, S, N, H) in that
    dtype. Query head n reads key/value head n // (N // K), the HF `repeat_kv` grouping. Scale is
    1/sqrt(H); scores and softmax are float32 in both implementations.

    segments: None, or int32 (B, S) segment ids that never decrease along a row, each document one run
    (`objective.document_segments`): query i then reads key j only where j <= i and
    segments[b, i] == segments[b, j]. XLA applies the mask `same_segment` to its float32 scores.
    cuDNN runs its packed layout (`q_offsets`/`kv_offsets` of
    `jax._src.cudnn.fused_attention_stablehlo.dot_product_attention`), which computes only the tiles
    inside documents: it is compiled for static numbers of documents per row
    (`packed_document_sizes`), so a micro-batch with a row of more documents than the largest, or a GPU
    or jax where the layout does not apply (`packed_layout_applies`), runs cuDNN with the mask as an
    additive bias (B, 1, S, S) instead: every causal tile computed, B * S * S bias bytes. All are
    exact; the choice is made per call on the device (`lax.switch`).
    `scripts/check_packed_attention.py` checks each against XLA and times them.

    window: None, or an int32 scalar (traced: one program serves every window): query i also reads
    only keys j > i - window (transformers' sliding window), as a dense (1, 1, S, S) mask beside the
    segments' (cuDNN takes it as its bias). local_window: the window of the model's local layers
    (static): with cuDNN and no segments, `windowed_attention` (the kernel's own sliding window, no
    dense mask). scale: the scores' factor (None: 1/sqrt(H)).
    """
    head_dim = q.shape[-1]
    impl = resolve_attention_impl(requested_impl, q.dtype, head_dim)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if impl == "cudnn" and segments is not None and window is None:
        return _cudnn_within_segments(q, k, v, segments, scale)
    if impl == "cudnn" and window is not None and segments is None and local_window is not None:
        return windowed_attention(q, k, v, impl, window, local_window, scale)
    mask = None if segments is None else same_segment(segments)
    if window is not None:
        s = q.shape[1]
        near = (jnp.arange(s)[:, None] - jnp.arange(s)[None, :] < window)[None, None]  # (1, 1, S, S)
        mask = near if mask is None else mask & near
        if impl == "cudnn":  # cuDNN's bias is per row: (B, 1, S, S), as the segments' mask is
            mask = jnp.broadcast_to(mask, (q.shape[0], 1, s, s))
    return _causal(q, k, v, mask, scale, impl)


def windowed_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    impl: AttentionImpl,
    window: jax.Array,
    local_window: int,
    scale: float,
) -> jax.Array:
    """`causal_attention` over the keys less than `window` (int32 scalar, traced) behind each query,
    where `window` is `local_window` (static) or spans the sequence: the kernel's own sliding window,
    or its plain causal mask, chosen on the device (`lax.switch`); any other window, the dense mask.
    `causal_attention` takes it for cuDNN, which then computes only the tiles inside the window (XLA
    computes every score either way, and measured slower through the switch: BENCHMARKS.md, "Issue 45
    on one H100, fourth session")."""
    dense = functools.partial(causal_attention, requested_impl=impl, window=window, scale=scale)
    branches = [
        functools.partial(
            _causal, mask=None, scale=scale, impl=impl, local_window_size=(local_window - 1, 0)
        ),
        functools.partial(_causal, mask=None, scale=scale, impl=impl),
        dense,
    ]
    which = jnp.where(window == local_window, 0, jnp.where(window >= q.shape[1], 1, 2))
    return jax.lax.switch(which, branches, q, k, v)


def _causal(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None,
    scale: float,
    impl: AttentionImpl,
    local_window_size: tuple[int, int] | None = None,
) -> jax.Array:
    """`jax.nn.dot_product_attention`, causal, in q's dtype."""
    dtype = q.dtype
    if impl == "xla" and dtype == jnp.float16:
        # XLA's CPU backend has no float16 x float16 -> float32 dot, which the XLA path asks for;
        # float16 inputs are exact in float32, so attend there and round once at the end.
        q, k, v = (t.astype(jnp.float32) for t in (q, k, v))
    out = jax.nn.dot_product_attention(
        q,
        k,
        v,
        mask=mask,
        scale=scale,
        is_causal=True,
        local_window_size=local_window_size,
        implementation=impl,
    )
    return out.astype(dtype)


def cached_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    pos: jax.Array,
    *,
    window: jax.Array | None = None,
    scale: float | None = None,
) -> jax.Array:
    """Attention of T new queries at positions pos .. pos+T-1 over a key/value cache.

    q (B, T, N, H); k_cache, v_cache (B, L, K, H) holding positions 0 .. pos+T-1 (the rest unused);
    pos int32 scalar -> (B, T, N, H) in q's dtype. Query i sees cache positions j <= pos + i: the
    causal attention of `causal_attention` over the whole sequence so far, grouped-query heads
    grouped the same way, scores and softmax in float32 (XLA's implementation). `window` and `scale`
    as in `causal_attention`.
    """
    t, length = q.shape[1], k_cache.shape[1]
    mask = jnp.arange(length)[None, :] <= pos + jnp.arange(t)[:, None]  # (T, L)
    if window is not None:
        mask = mask & (pos + jnp.arange(t)[:, None] - jnp.arange(length)[None, :] < window)
    f32 = q.dtype == jnp.float16  # XLA:CPU has no float16 dot with a float32 result
    args = [x.astype(jnp.float32) if f32 else x for x in (q, k_cache, v_cache)]
    out = jax.nn.dot_product_attention(
        *args,
        mask=mask[None, None],
        scale=1.0 / math.sqrt(q.shape[-1]) if scale is None else scale,
        implementation="xla",
    )
    return out.astype(q.dtype)

"""Model package tests: shapes and dtypes, causality, a float64 NumPy reference, parameter counts,
FLOPs accounting, named sizes and deterministic init.

The NumPy reference below is written from the published model definitions (HF LlamaForCausalLM and
GPT2LMHeadModel semantics), independently of jaxzero.models: it shares only the pytree layout (the
interface), not a line of math.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxzero.config import ConfigError, ModelConfig
from jaxzero.models import ModelParams, build_model, forward
from jaxzero.models.layers import causal_attention, logits_matmul, resolve_attention_impl, windowed_attention
from jaxzero.models.sizes import (
    NAMED_SIZES,
    flops_per_token,
    matmul_param_count,
    param_count,
    unit_param_counts,
)

# ---------------------------------------------------------------------------------------------------
# Small configs
# ---------------------------------------------------------------------------------------------------

# Odd vocab, GQA with 2 query heads per kv head, head_dim 8, MLP width not a multiple of D.
LLAMA_SMALL = ModelConfig(
    name="llama-test",
    family="llama",
    vocab_size=61,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=48,
    max_seq_len=64,
    tie_embeddings=False,
    rope_theta=100.0,
    norm_eps=1e-5,
    compute_dtype="float32",
    attention_impl="xla",
)
LLAMA_SMALL_TIED = dataclasses.replace(LLAMA_SMALL, tie_embeddings=True, num_kv_heads=1)
GPT2_SMALL = ModelConfig(
    name="gpt2-test",
    family="gpt2",
    vocab_size=61,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=4,
    intermediate_size=80,
    max_seq_len=24,
    tie_embeddings=True,
    norm_eps=1e-5,
    compute_dtype="float32",
    attention_impl="xla",
)
SMALL_CONFIGS = {"llama": LLAMA_SMALL, "llama-tied-mqa": LLAMA_SMALL_TIED, "gpt2": GPT2_SMALL}
# For the init tests: shapes chosen so that few distinct (shape, std) samplers exist, since each one is
# compiled separately when `init` runs eagerly.
INIT_CONFIGS = {
    "llama": dataclasses.replace(LLAMA_SMALL, vocab_size=32, num_kv_heads=4, intermediate_size=32),
    "gpt2": dataclasses.replace(GPT2_SMALL, vocab_size=32, intermediate_size=96, max_seq_len=32),
}
B, S = 2, 12


class Outputs(NamedTuple):
    embed: jax.Array  # model.embed(tokens)
    block: jax.Array  # model.block(blocks[0], x)
    head: jax.Array  # model.head(x)
    logits: jax.Array  # forward(tokens)


@functools.cache
def _run_all(cfg: ModelConfig) -> Callable[[ModelParams, jax.Array, jax.Array], Outputs]:
    """One jitted function evaluating every unit of `cfg`'s model (unit outputs on the given x, plus the
    full forward), cached per config: compilation dominates this file's run time."""
    model = build_model(cfg)

    def run(params: ModelParams, tokens: jax.Array, x: jax.Array) -> Outputs:
        return Outputs(
            embed=model.embed(params.embed, tokens),
            block=model.block(params.blocks[0], x),
            head=model.head(params.head, params.embed, x),
            logits=forward(model, params, tokens),
        )

    return jax.jit(run)


def _with_dtype(cfg: ModelConfig, dtype: str) -> ModelConfig:
    return dataclasses.replace(cfg, compute_dtype=dtype)


def _tokens(cfg: ModelConfig, seed: int = 0, shape: tuple[int, int] = (B, S)) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).integers(0, cfg.vocab_size, shape), jnp.int32)


def _leaf_name(path: tuple[Any, ...]) -> str:
    return path[-1].key


def _random_params(cfg: ModelConfig, seed: int = 0) -> ModelParams:
    """float32 params with the model's layout and non-trivial values (init's ones/zeros would hide a
    swapped norm scale or bias). Kernels ~ N(0, 1/fan_in) keep activations O(1), so attention is far from
    uniform and rope/masking errors show up in the outputs."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(build_model(cfg).init, jax.random.key(0))

    def fill(path: tuple[Any, ...], leaf: jax.ShapeDtypeStruct) -> jax.Array:
        name = _leaf_name(path)
        if name == "kernel":
            x = rng.standard_normal(leaf.shape) / math.sqrt(leaf.shape[0])
        elif name == "embedding":
            x = rng.standard_normal(leaf.shape)
        elif name == "scale":
            x = 1.0 + 0.2 * rng.standard_normal(leaf.shape)
        elif name == "bias":
            x = 0.1 * rng.standard_normal(leaf.shape)
        else:
            raise AssertionError(f"unexpected leaf name {name!r}")
        return jnp.asarray(x, jnp.float32)

    return jax.tree_util.tree_map_with_path(fill, shapes)


def _to_f64(tree: Any) -> Any:
    return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


def _rel_err(out: Any, ref: np.ndarray) -> float:
    out = np.asarray(out, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


# ---------------------------------------------------------------------------------------------------
# Independent float64 NumPy reference
# ---------------------------------------------------------------------------------------------------


def np_rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def np_layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def np_rope_hf(x: np.ndarray, theta: float) -> np.ndarray:
    """HF rotate-half rope on x (B, S, N, H), written as explicit 2-D rotations of the pairs (i, i + H/2)."""
    h = x.shape[-1]
    half = h // 2
    out = np.empty_like(x)
    for s in range(x.shape[1]):
        for i in range(half):
            angle = s / theta ** (2 * i / h)
            c, sn = math.cos(angle), math.sin(angle)
            a, b = x[:, s, :, i], x[:, s, :, i + half]
            out[:, s, :, i] = a * c - b * sn
            out[:, s, :, i + half] = b * c + a * sn
    return out


def np_causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """q (B, S, N, H), k/v (B, S, K, H); query head n reads kv head n // (N/K) (HF repeat_kv)."""
    _, s, n, h = q.shape
    group = n // k.shape[2]
    out = np.zeros_like(q)
    mask = np.tril(np.ones((s, s), bool))
    for head in range(n):
        kh, vh = k[:, :, head // group], v[:, :, head // group]
        scores = np.einsum("bth,bsh->bts", q[:, :, head], kh) / math.sqrt(h)
        scores = np.where(mask, scores, -np.inf)
        scores = scores - scores.max(axis=-1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=-1, keepdims=True)
        out[:, :, head] = np.einsum("bts,bsh->bth", p, vh)
    return out


def np_llama_block(p: dict, x: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    b, s, _ = x.shape
    hd = cfg.hidden_size // cfg.num_heads
    a = p["self_attn"]
    h = np_rms_norm(x, p["input_layernorm"]["scale"], cfg.norm_eps)
    q = (h @ a["q_proj"]["kernel"]).reshape(b, s, cfg.num_heads, hd)
    k = (h @ a["k_proj"]["kernel"]).reshape(b, s, cfg.num_kv_heads, hd)
    v = (h @ a["v_proj"]["kernel"]).reshape(b, s, cfg.num_kv_heads, hd)
    o = np_causal_attention(np_rope_hf(q, cfg.rope_theta), np_rope_hf(k, cfg.rope_theta), v)
    x = x + o.reshape(b, s, -1) @ a["o_proj"]["kernel"]
    m = p["mlp"]
    h = np_rms_norm(x, p["post_attention_layernorm"]["scale"], cfg.norm_eps)
    gate = h @ m["gate_proj"]["kernel"]
    silu = gate / (1.0 + np.exp(-gate))
    return x + (silu * (h @ m["up_proj"]["kernel"])) @ m["down_proj"]["kernel"]


def np_gpt2_block(p: dict, x: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    b, s, d = x.shape
    hd = d // cfg.num_heads
    a = p["attn"]
    h = np_layer_norm(x, p["ln_1"]["scale"], p["ln_1"]["bias"], cfg.norm_eps)
    qkv = h @ a["c_attn"]["kernel"] + a["c_attn"]["bias"]
    q, k, v = (qkv[..., i * d : (i + 1) * d].reshape(b, s, cfg.num_heads, hd) for i in range(3))
    o = np_causal_attention(q, k, v)
    x = x + o.reshape(b, s, d) @ a["c_proj"]["kernel"] + a["c_proj"]["bias"]
    m = p["mlp"]
    h = np_layer_norm(x, p["ln_2"]["scale"], p["ln_2"]["bias"], cfg.norm_eps)
    u = h @ m["c_fc"]["kernel"] + m["c_fc"]["bias"]
    gelu = 0.5 * u * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (u + 0.044715 * u**3)))
    return x + gelu @ m["c_proj"]["kernel"] + m["c_proj"]["bias"]


def np_embed(p: ModelParams, tokens: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    if cfg.family == "llama":
        return p.embed["embed_tokens"]["embedding"][tokens]
    s = tokens.shape[1]
    return p.embed["wte"]["embedding"][tokens] + p.embed["wpe"]["embedding"][:s][None]


def np_block(p: dict, x: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    return np_llama_block(p, x, cfg) if cfg.family == "llama" else np_gpt2_block(p, x, cfg)


def np_head(p: ModelParams, x: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    if cfg.family == "llama":
        h = np_rms_norm(x, p.head["norm"]["scale"], cfg.norm_eps)
        if cfg.tie_embeddings:
            return h @ p.embed["embed_tokens"]["embedding"].T
        return h @ p.head["lm_head"]["kernel"]
    h = np_layer_norm(x, p.head["ln_f"]["scale"], p.head["ln_f"]["bias"], cfg.norm_eps)
    return h @ p.embed["wte"]["embedding"].T


def np_forward(p: ModelParams, tokens: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    x = np_embed(p, tokens, cfg)
    for bp in p.blocks:
        x = np_block(bp, x, cfg)
    return np_head(p, x, cfg)


# ---------------------------------------------------------------------------------------------------
# Reference comparisons
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
@pytest.mark.parametrize("which", list(SMALL_CONFIGS))
def test_matches_numpy_reference(which: str, dtype: str, tol: float) -> None:
    cfg = _with_dtype(SMALL_CONFIGS[which], dtype)
    params = _random_params(cfg, seed=1)
    ref_params = _to_f64(params)
    tokens = _tokens(cfg, seed=2)
    tok_np = np.asarray(tokens)

    # Each unit against the reference on the reference's own inputs (errors do not compound).
    x_ref = np_embed(ref_params, tok_np, cfg)
    x_in = jnp.asarray(x_ref, build_model(cfg).dtype)
    x_in_ref = np.asarray(x_in, np.float64)
    out = _run_all(cfg)(params, tokens, x_in)
    assert _rel_err(out.embed, x_ref) < tol
    block_ref = np_block(ref_params.blocks[0], x_in_ref, cfg)
    assert _rel_err(out.block, block_ref) < tol
    # The residual branch alone, so a small error in attention/MLP cannot hide behind the skip path.
    assert _rel_err(np.asarray(out.block, np.float64) - x_in_ref, block_ref - x_in_ref) < tol
    assert _rel_err(out.head, np_head(ref_params, x_in_ref, cfg)) < tol

    # End to end.
    logits = out.logits
    assert logits.dtype == jnp.float32
    assert _rel_err(logits, np_forward(ref_params, tok_np, cfg)) < tol


def test_reference_sanity() -> None:
    """The reference is a demanding target with these params: rope has a large effect (so a model that
    skipped or mis-paired the rotation could not pass the comparison above) and the block's residual
    branch is O(1), not negligible next to the skip path."""
    cfg = LLAMA_SMALL
    p = _to_f64(_random_params(cfg, seed=1))
    x = np_embed(p, np.asarray(_tokens(cfg, seed=2)), cfg)
    out = np_block(p.blocks[0], x, cfg)
    assert np.isfinite(out).all()
    assert np.linalg.norm(out - x) > 0.3 * np.linalg.norm(x)
    # Without positions, attention at t is invariant to permuting the keys before t; with rope it is not.
    t = 6
    x_perm = x.copy()
    x_perm[:, :t] = x[:, :t][:, ::-1]
    out_perm = np_block(p.blocks[0], x_perm, cfg)
    assert np.abs(out_perm[:, t:] - out[:, t:]).max() > 1e-2


# ---------------------------------------------------------------------------------------------------
# Shapes, dtypes, causality, precision plumbing
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny"])
def test_shapes_and_dtypes(name: str, dtype: str) -> None:
    """Abstract evaluation (no compilation): values are covered by the reference comparison."""
    cfg = dataclasses.replace(ModelConfig.named(name), compute_dtype=dtype)
    model = build_model(cfg)
    params = jax.eval_shape(model.init, jax.random.key(0))
    assert len(params.blocks) == cfg.num_layers
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(params))
    tokens = jax.ShapeDtypeStruct((2, 16), jnp.int32)
    x = jax.eval_shape(model.embed, params.embed, tokens)
    assert x.shape == (2, 16, cfg.hidden_size) and x.dtype == jnp.dtype(dtype)
    y = jax.eval_shape(model.block, params.blocks[0], x)
    assert y.shape == x.shape and y.dtype == jnp.dtype(dtype)
    # Blocks also take compute-dtype params (what the offload engine streams) and float32 activations.
    cast = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.dtype(dtype)), params.blocks[0])
    y2 = jax.eval_shape(model.block, cast, jax.ShapeDtypeStruct(x.shape, jnp.float32))
    assert y2.shape == x.shape and y2.dtype == jnp.dtype(dtype)
    logits = jax.eval_shape(model.head, params.head, params.embed, y)
    assert logits.shape == (2, 16, cfg.vocab_size) and logits.dtype == jnp.float32
    full = jax.eval_shape(lambda p, t: forward(model, p, t), params, tokens)
    assert full.shape == (2, 16, cfg.vocab_size) and full.dtype == jnp.float32


def test_units_in_forward_order_and_back() -> None:
    """`units()` is `[embed, *blocks, head]` (index = the plan's unit position); `from_units` inverts it."""
    params = ModelParams(embed="e", blocks=("b0", "b1", "b2"), head="h")
    assert params.units() == ["e", "b0", "b1", "b2", "h"]
    assert ModelParams.from_units(params.units()) == params
    assert ModelParams.from_units(("e", "h")) == ModelParams("e", (), "h")  # no blocks
    real = build_model(LLAMA_SMALL).init(jax.random.PRNGKey(0))
    again = ModelParams.from_units(real.units())
    assert jax.tree.structure(again) == jax.tree.structure(real)
    assert all(a is b for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(real), strict=True))


@pytest.mark.parametrize("which", list(SMALL_CONFIGS))
def test_units_accept_compute_dtype_params(which: str) -> None:
    """bf16 weights (as the offload engine streams them) give exactly the result of f32 masters."""
    cfg = _with_dtype(SMALL_CONFIGS[which], "bfloat16")
    params = _random_params(cfg)
    bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    tokens = _tokens(cfg)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((B, S, cfg.hidden_size)), jnp.bfloat16)
    from_f32 = _run_all(cfg)(params, tokens, x)
    from_bf16 = _run_all(cfg)(bf16, tokens, x)
    for a, b in zip(from_f32, from_bf16, strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("which", list(SMALL_CONFIGS))
def test_causal(which: str, dtype: str) -> None:
    cfg = _with_dtype(SMALL_CONFIGS[which], dtype)
    params = _random_params(cfg)
    x = jnp.zeros((B, S, cfg.hidden_size), build_model(cfg).dtype)

    def run(p: ModelParams, t: jax.Array) -> jax.Array:
        return _run_all(cfg)(p, t, x).logits

    tokens = _tokens(cfg, seed=3)
    base = np.asarray(run(params, tokens))
    for k in (1, 5, S - 1):
        changed = tokens.at[:, k:].set((tokens[:, k:] + 1 + jnp.arange(S - k)[None, :]) % cfg.vocab_size)
        out = np.asarray(run(params, changed))
        np.testing.assert_allclose(out[:, :k], base[:, :k], rtol=0, atol=1e-6)
        assert np.abs(out[:, k:] - base[:, k:]).max() > 1e-3  # the later positions did see the change


@pytest.mark.parametrize("which", ["llama", "gpt2"])
def test_gradients_flow(which: str) -> None:
    """jit(grad) through the whole model: finite float32 gradients of the masters for every leaf."""
    # One layer: every block is the same function, and compiling a deeper grad only costs test time.
    cfg = dataclasses.replace(_with_dtype(SMALL_CONFIGS[which], "bfloat16"), num_layers=1)
    model = build_model(cfg)
    params = _random_params(cfg)
    tokens = _tokens(cfg)

    def loss(p: ModelParams) -> jax.Array:
        logits = forward(model, p, tokens)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[..., None], axis=-1))

    grads = jax.jit(jax.grad(loss))(params)
    assert jax.tree.structure(grads) == jax.tree.structure(params)
    for g in jax.tree.leaves(grads):
        assert g.dtype == jnp.float32 and bool(jnp.isfinite(g).all())
    down = grads.blocks[0]["mlp"]["down_proj" if which == "llama" else "c_proj"]["kernel"]
    assert float(jnp.abs(down).max()) > 0


def test_logits_matmul_vjp() -> None:
    """The custom VJP is the exact gradient in float32 and keeps bf16 operands' gradients in bf16."""
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.standard_normal((2, 3, 8)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((8, 5)), jnp.float32)
    t = jnp.asarray(rng.standard_normal((2, 3, 5)), jnp.float32)

    def custom(h: jax.Array, w: jax.Array) -> jax.Array:
        return jnp.sum(logits_matmul(h, w) * t)

    def plain(h: jax.Array, w: jax.Array) -> jax.Array:
        return jnp.sum(jnp.einsum("bsd,dv->bsv", h, w) * t)

    for g_c, g_p in zip(jax.grad(custom, (0, 1))(h, w), jax.grad(plain, (0, 1))(h, w), strict=True):
        np.testing.assert_allclose(g_c, g_p, rtol=1e-6, atol=1e-6)
    hb, wb = h.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    assert logits_matmul(hb, wb).dtype == jnp.float32
    dh, dw = jax.grad(custom, (0, 1))(hb, wb)
    assert dh.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(dh, np.float32), np.asarray(jax.grad(plain)(h, w)), rtol=0.05, atol=0.05
    )


def test_attention_impl_resolution() -> None:
    assert jax.default_backend() == "cpu"
    assert resolve_attention_impl("xla", jnp.bfloat16, 64) == "xla"
    assert resolve_attention_impl("auto", jnp.bfloat16, 64) == "xla"  # no CUDA GPU here
    assert resolve_attention_impl("auto", jnp.float32, 64) == "xla"
    with pytest.raises(ConfigError, match="attention_impl=cudnn"):
        resolve_attention_impl("cudnn", jnp.bfloat16, 64)
    with pytest.raises(ConfigError, match="attention_impl"):
        resolve_attention_impl("flash", jnp.bfloat16, 64)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_a_local_window_runs_the_kernels_own_window_and_equals_the_dense_mask(dtype) -> None:
    """`windowed_attention` (cuDNN's path for a model's local layers; run here through XLA): a layer
    whose traced window is the local one runs the kernel's sliding window and one whose window spans
    the sequence its causal mask; any other window the dense mask. Each equals the dense mask's output
    and gradients, and the numpy reference of its window."""
    b, s, n, kv, h, local = 2, 12, 4, 2, 8, 5
    keys = jax.random.split(jax.random.key(3), 4)
    q = jax.random.normal(keys[0], (b, s, n, h)).astype(dtype)
    k, v = (jax.random.normal(key, (b, s, kv, h)).astype(dtype) for key in keys[1:3])
    cot = jax.random.normal(keys[3], (b, s, n, h), jnp.float32)

    @functools.partial(jax.jit, static_argnames="local_window")
    def run(q, k, v, window, local_window):
        def loss(q, k, v):
            if local_window is None:
                o = causal_attention(q, k, v, "xla", window=window)
            else:
                o = windowed_attention(q, k, v, "xla", window, local_window, 1 / math.sqrt(h))
            return jnp.sum(o.astype(jnp.float32) * cot), o

        return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)

    for window in (local, 2**30, s, 3):
        (_, out), grads = run(q, k, v, jnp.int32(window), local)
        (_, dense), dense_grads = run(q, k, v, jnp.int32(window), None)
        assert out.dtype == dtype
        np.testing.assert_allclose(
            np.asarray(out, np.float32), np.asarray(dense, np.float32), rtol=1e-6, atol=1e-6
        )
        for a, c in zip(grads, dense_grads):
            np.testing.assert_allclose(
                np.asarray(a, np.float32), np.asarray(c, np.float32), rtol=1e-5, atol=1e-5
            )
        qn, kn, vn = (np.asarray(t, np.float64) for t in (q, k, v))
        i, j = np.arange(s)[:, None], np.arange(s)[None, :]
        want = np.zeros((b, s, n, h))
        for head in range(n):
            scores = np.einsum("bth,bsh->bts", qn[:, :, head], kn[:, :, head // 2]) / math.sqrt(h)
            scores = np.where((j <= i) & (i - j < window), scores, -np.inf)
            p = np.exp(scores - scores.max(axis=-1, keepdims=True))
            want[:, :, head] = np.einsum(
                "bts,bsh->bth", p / p.sum(axis=-1, keepdims=True), vn[:, :, head // 2]
            )
        tol = 1e-5 if dtype == jnp.float32 else 2e-3
        np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=tol, atol=tol)


def test_gpt2_rejects_too_long_sequences() -> None:
    model = build_model(GPT2_SMALL)
    params = jax.eval_shape(model.init, jax.random.key(0))
    too_long = jax.ShapeDtypeStruct((1, GPT2_SMALL.max_seq_len + 1), jnp.int32)
    with pytest.raises(ValueError, match="max_seq_len"):
        jax.eval_shape(model.embed, params.embed, too_long)


def test_model_rejects_wrong_family_and_bad_shapes() -> None:
    from jaxzero.models.gpt2 import GPT2
    from jaxzero.models.llama import Llama

    with pytest.raises(ConfigError):
        Llama(GPT2_SMALL)
    with pytest.raises(ConfigError):
        GPT2(LLAMA_SMALL)
    with pytest.raises(ConfigError, match="num_kv_heads"):
        GPT2(dataclasses.replace(GPT2_SMALL, num_kv_heads=2))
    with pytest.raises(ConfigError, match="divisible"):
        Llama(dataclasses.replace(LLAMA_SMALL, num_kv_heads=3))


# ---------------------------------------------------------------------------------------------------
# Init
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["llama", "gpt2"])
def test_init_is_deterministic_and_jittable(which: str) -> None:
    model = build_model(INIT_CONFIGS[which])
    key = jax.random.key(42)
    a = model.init(key)
    b = model.init(key)
    c = jax.jit(model.init)(key)
    for x, y, z in zip(jax.tree.leaves(a), jax.tree.leaves(b), jax.tree.leaves(c), strict=True):
        np.testing.assert_array_equal(x, y)
        np.testing.assert_array_equal(x, z)
    assert isinstance(c, ModelParams)
    assert jax.tree.structure(a) == jax.tree.structure(c)
    # Blocks share structure, shapes and dtypes, but not values (each layer has its own key).
    ref = jax.tree.map(lambda t: (t.shape, t.dtype), a.blocks[0])
    for blk in a.blocks:
        assert jax.tree.structure(blk) == jax.tree.structure(a.blocks[0])
        assert jax.tree.map(lambda t: (t.shape, t.dtype), blk) == ref
    k0 = jax.tree.leaves(a.blocks[0])
    k1 = jax.tree.leaves(a.blocks[1])
    assert any(not np.array_equal(x, y) for x, y in zip(k0, k1, strict=True))
    other = model.init(jax.random.key(43))
    assert not np.array_equal(jax.tree.leaves(other.embed)[0], jax.tree.leaves(a.embed)[0])
    # Raw uint32 PRNGKeys work too (abstractly: the values are the same code path).
    assert jax.tree.structure(jax.eval_shape(model.init, jax.random.PRNGKey(0))) == jax.tree.structure(a)


def test_init_distributions() -> None:
    """Normal(0, init_std) matrices and embeddings, GPT-2's c_proj at init_std/sqrt(2L), ones for norm
    scales, zeros for biases. Samples are pooled over layers (thousands per group, so 5% is > 3 sigma)."""

    def pooled_std(p: ModelParams, keep: Callable[[str], bool]) -> float:
        leaves = [
            leaf
            for path, leaf in jax.tree_util.tree_leaves_with_path(p.blocks)
            if _leaf_name(path) == "kernel" and keep(jax.tree_util.keystr(path))
        ]
        return float(np.concatenate([np.ravel(leaf) for leaf in leaves]).std())

    for cfg in INIT_CONFIGS.values():
        p = build_model(cfg).init(jax.random.key(7))
        std = cfg.init_std
        tables = [p.embed, p.head.get("lm_head", {})]
        np.testing.assert_allclose(
            np.concatenate([np.ravel(t) for t in jax.tree.leaves(tables)]).std(), std, rtol=0.05
        )
        if cfg.family == "gpt2":
            resid = std / math.sqrt(2 * cfg.num_layers)
            np.testing.assert_allclose(pooled_std(p, lambda k: "c_proj" not in k), std, rtol=0.05)
            np.testing.assert_allclose(pooled_std(p, lambda k: "c_proj" in k), resid, rtol=0.05)
        else:
            np.testing.assert_allclose(pooled_std(p, lambda k: True), std, rtol=0.05)
        for path, leaf in jax.tree_util.tree_leaves_with_path(p):
            if _leaf_name(path) == "scale":
                assert bool((leaf == 1).all())
            elif _leaf_name(path) == "bias":
                assert bool((leaf == 0).all())
            else:
                assert abs(float(jnp.mean(leaf))) < 0.1 * std


def test_hf_names() -> None:
    """Pytree keys are the HF names the conversion code will map (a rename here must be deliberate)."""
    lp = jax.eval_shape(build_model(ModelConfig.named("llama-tiny")).init, jax.random.key(0))
    assert set(lp.embed) == {"embed_tokens"}
    assert set(lp.blocks[0]) == {"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"}
    assert set(lp.blocks[0]["self_attn"]) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert set(lp.blocks[0]["mlp"]) == {"gate_proj", "up_proj", "down_proj"}
    assert set(lp.head) == {"norm", "lm_head"}
    tied = jax.eval_shape(build_model(LLAMA_SMALL_TIED).init, jax.random.key(0))
    assert set(tied.head) == {"norm"}
    gp = jax.eval_shape(build_model(ModelConfig.named("gpt2-tiny")).init, jax.random.key(0))
    assert set(gp.embed) == {"wte", "wpe"}
    assert set(gp.blocks[0]) == {"ln_1", "attn", "ln_2", "mlp"}
    assert set(gp.blocks[0]["attn"]) == {"c_attn", "c_proj"}
    assert set(gp.blocks[0]["mlp"]) == {"c_fc", "c_proj"}
    assert set(gp.head) == {"ln_f"}
    assert all(type(t) is dict for t in (lp.embed, lp.head, lp.blocks[0], gp.blocks[0]))


# ---------------------------------------------------------------------------------------------------
# Named sizes, parameter counts, FLOPs
# ---------------------------------------------------------------------------------------------------

PUBLISHED_COUNTS = {
    "gpt2-small": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
    "llama-1b": 1_235_814_400,
    "llama-3b": 3_212_749_824,
    "llama-7b": 6_738_415_616,
    "llama-13b": 13_015_864_320,
    "llama-20b": 19_861_149_696,  # computed from the InternLM2-20B shape; ~19.86B as published
    "llama-30b": 32_528_943_616,
    "llama-70b": 68_976_648_192,  # Llama 2 70B's ~68.98B
    "llama-3.4b-bench": 3_367_676_928,
    # released checkpoints, as their model cards count them
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-14b": 14_770_033_664,
    "mistral-7b": 7_248_023_552,
}


def _qwen3_count(
    hidden: int, layers: int, heads: int, kv: int, head_dim: int, mlp: int, vocab: int, tie: bool
) -> int:
    """Parameters of a Qwen3 checkpoint from its config.json's numbers, written out from
    transformers' Qwen3ForCausalLM: per layer q, k, v, o (no biases), the SwiGLU's three matrices, two
    RMSNorms of the width and the q/k norms of one head's width; the embedding, the final norm, and
    the head unless tied."""
    q, k = heads * head_dim, kv * head_dim
    layer = hidden * q + 2 * hidden * k + q * hidden + 3 * hidden * mlp + 2 * hidden + 2 * head_dim
    return vocab * hidden + layers * layer + hidden + (0 if tie else hidden * vocab)


# The released Qwen3 configs (Qwen/Qwen3-*'s config.json: hidden_size, num_hidden_layers,
# num_attention_heads, num_key_value_heads, head_dim, intermediate_size, vocab_size,
# tie_word_embeddings), and the totals and non-embedding counts their model cards publish.
QWEN3_RELEASED = {
    "qwen3-0.6b": ((1024, 28, 16, 8, 128, 3072, 151936, True), "0.6B", "0.44B"),
    "qwen3-1.7b": ((2048, 28, 16, 8, 128, 6144, 151936, True), "1.7B", "1.4B"),
    "qwen3-4b": ((2560, 36, 32, 8, 128, 9728, 151936, True), "4.0B", "3.6B"),
    "qwen3-8b": ((4096, 36, 32, 8, 128, 12288, 151936, False), "8.2B", "6.95B"),
    "qwen3-14b": ((5120, 40, 40, 8, 128, 17408, 151936, False), "14.8B", "13.2B"),
    "qwen3-32b": ((5120, 64, 64, 8, 128, 25600, 151936, False), "32.8B", "31.2B"),
}
PUBLISHED_COUNTS.update({name: _qwen3_count(*shape) for name, (shape, _, _) in QWEN3_RELEASED.items()})


def _moe_count(
    hidden: int, layers: int, heads: int, kv: int, head_dim: int, experts: int, width: int, vocab: int
) -> tuple[int, int]:
    """(total, per-token) parameters of a Qwen3-MoE (q/k norms) or Mixtral (none: head_dim 0) model
    from its config.json's numbers, written out from transformers' Qwen3MoeForCausalLM and
    MixtralForCausalLM: per layer q, k, v, o, the router (E, D), every expert's gate, up (F, D) and
    down (D, F), two RMSNorms of the width (and the q/k norms); untied embedding and head, final norm.
    Per token: the top-k experts only (k = 8 for Qwen3, 2 for Mixtral)."""
    top_k = 8 if head_dim else 2
    hd = head_dim or hidden // heads
    q, k = heads * hd, kv * hd
    attention = hidden * q + 2 * hidden * k + q * hidden + 2 * hidden + (2 * hd if head_dim else 0)
    outside = 2 * vocab * hidden + hidden
    total = outside + layers * (attention + hidden * experts + experts * 3 * hidden * width)
    active = outside + layers * (attention + hidden * experts + top_k * 3 * hidden * width)
    return total, active


# The released MoE configs (Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B, mistralai/Mixtral-8x7B-v0.1:
# hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim (Mixtral: none),
# num_experts, moe_intermediate_size (Mixtral: intermediate_size), vocab_size; all untied), and the
# totals their model cards publish: 30.5B (3.3B activated), 235B (22B activated), 46.7B (12.9B
# active). Qwen's activated counts leave out something the formula keeps (3.35B and 22.1B here).
MOE_RELEASED = {
    "qwen3-30b-a3b": ((2048, 48, 32, 4, 128, 128, 768, 151936), "30.5B", 30_532_122_624),
    "qwen3-235b-a22b": ((4096, 94, 64, 4, 128, 128, 1536, 151936), "235B", 235_093_634_560),
    "mixtral-8x7b": ((4096, 32, 32, 8, 0, 8, 14336, 32000), "46.7B", 46_702_792_704),
}
PUBLISHED_COUNTS.update({name: count for name, (_, _, count) in MOE_RELEASED.items()})


@pytest.mark.parametrize("name", list(MOE_RELEASED))
def test_moe_sizes_are_the_released_configs(name: str) -> None:
    """Each MoE size is its released config: the count of the config's numbers is the named size's,
    rounds to the published total, and its FLOPs count the top-k experts (Mixtral: 12.9B active)."""
    shape, published, count = MOE_RELEASED[name]
    hidden, layers, heads, kv, head_dim, experts, width, vocab = shape
    cfg = ModelConfig.named(name)
    total, active = _moe_count(*shape)
    assert total == count == param_count(cfg)
    digits = len(published.split(".")[1]) - 1 if "." in published else 0
    assert f"{total / 1e9:.{digits}f}B" == published
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (
        hidden,
        layers,
        heads,
        kv,
        vocab,
    )
    assert (cfg.num_experts, cfg.moe_intermediate_size, cfg.tie_embeddings, cfg.rope_theta) == (
        experts,
        width,
        False,
        1e6,
    )
    assert cfg.qk_norm == bool(head_dim) and cfg.hf_model_type == ("qwen3_moe" if head_dim else "mixtral")
    # FLOPs: 6 per multiplied weight (the embedding is a lookup, the norms no matmul).
    matmul = active - vocab * hidden - (2 * hidden + (2 * head_dim if head_dim else 0)) * layers - hidden
    assert matmul_param_count(cfg) == matmul
    if name == "mixtral-8x7b":
        assert f"{active / 1e9:.1f}B" == "12.9B"


def _gemma3_count(hidden: int, layers: int, heads: int, kv: int, head_dim: int, mlp: int, vocab: int) -> int:
    """Parameters of a Gemma 3 text model from its config's numbers, written out from transformers'
    Gemma3ForCausalLM: per layer q, k, v, o (no biases), the GeGLU's three matrices, four RMSNorms of
    the width and the q/k norms of one head's width; the embedding (the head is tied) and the final
    norm."""
    q, k = heads * head_dim, kv * head_dim
    layer = hidden * q + 2 * hidden * k + q * hidden + 3 * hidden * mlp + 4 * hidden + 2 * head_dim
    return vocab * hidden + layers * layer + hidden


# The released Gemma 3 text configs (google/gemma-3-1b-pt's config.json, and the text_config of the 4B,
# 12B and 27B: hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim,
# intermediate_size, vocab_size), and their text models' published sizes (the 4B, 12B and 27B
# checkpoints also hold a ~0.42B vision tower, which is not counted here: 4.3B, 12.2B, 27.4B in all).
GEMMA3_RELEASED = {
    "gemma-3-1b": ((1152, 26, 4, 1, 256, 6912, 262144), 999_885_952),
    "gemma-3-4b": ((2560, 34, 8, 4, 256, 10240, 262208), 3_880_263_168),
    "gemma-3-12b": ((3840, 48, 16, 8, 256, 15360, 262208), 11_766_034_176),
    "gemma-3-27b": ((5376, 62, 32, 16, 128, 21504, 262208), 27_009_346_304),
}
PUBLISHED_COUNTS.update({name: _gemma3_count(*shape) for name, (shape, _) in GEMMA3_RELEASED.items()})
# gpt-oss 20B and 120B: the model card's 20.91B and 116.83B (tests/test_gpt_oss.py counts them).
PUBLISHED_COUNTS.update({"gpt-oss-20b": 20_914_757_184, "gpt-oss-120b": 116_829_156_672})


@pytest.mark.parametrize("name", list(GEMMA3_RELEASED))
def test_gemma3_sizes_are_the_released_configs(name: str) -> None:
    (hidden, layers, heads, kv, head_dim, mlp, vocab), published = GEMMA3_RELEASED[name]
    cfg = ModelConfig.named(name)
    assert _gemma3_count(hidden, layers, heads, kv, head_dim, mlp, vocab) == published
    assert (cfg.family, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        "gemma3",
        hidden,
        layers,
        heads,
        kv,
        head_dim,
    )
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.tie_embeddings) == (mlp, vocab, True)
    # Five local layers of window 512 (1B) or 1024 to one global; global rope scaled by 8 from 4B on.
    assert (cfg.sliding_window_pattern, cfg.sliding_window, cfg.rope_local_theta, cfg.rope_theta) == (
        6,
        512 if name == "gemma-3-1b" else 1024,
        1e4,
        1e6,
    )
    assert (cfg.rope_type, cfg.rope_factor) == (("default", 1.0) if name == "gemma-3-1b" else ("linear", 8.0))
    assert cfg.query_pre_attn_scalar == (168 if name == "gemma-3-27b" else 256)


def _phi3_olmo2_count(hidden: int, layers: int, heads: int, kv: int, mlp: int, vocab: int, olmo: bool) -> int:
    """Parameters of a Phi-3 or OLMo 2 checkpoint from its config.json's numbers, written out from
    transformers' Phi3ForCausalLM (qkv_proj (q + 2k, D), o_proj, gate_up_proj (2F, D), down_proj, two
    RMSNorms of the width) and Olmo2ForCausalLM (q, k, v, o, the three SwiGLU matrices, two RMSNorms
    of the width and q_norm, k_norm of the projections' widths); untied embedding and head, final norm."""
    q, k = hidden, kv * (hidden // heads)
    layer = hidden * (q + 2 * k) + q * hidden + 3 * hidden * mlp + 2 * hidden + ((q + k) if olmo else 0)
    return 2 * vocab * hidden + layers * layer + hidden


# The released configs (microsoft/Phi-3-mini-4k-instruct, microsoft/phi-4, allenai/OLMo-2-1124-7B,
# -1124-13B, -0325-32B: hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
# intermediate_size, vocab_size; all untied), and the totals published for them (Phi-3-mini's
# technical report: 3.8B; the Hub's counts of the safetensors: 14.7B, 7.3B, 13.7B, 32.2B).
PHI3_OLMO2_RELEASED = {
    "phi-3-mini": ((3072, 32, 32, 32, 8192, 32064), "3.8B"),
    "phi-4": ((5120, 40, 40, 10, 17920, 100352), "14.7B"),
    "olmo-2-7b": ((4096, 32, 32, 32, 11008, 100352), "7.3B"),
    "olmo-2-13b": ((5120, 40, 40, 40, 13824, 100352), "13.7B"),
    "olmo-2-32b": ((5120, 64, 40, 8, 27648, 100352), "32.2B"),
}
PUBLISHED_COUNTS.update(
    {n: _phi3_olmo2_count(*shape, n.startswith("olmo")) for n, (shape, _) in PHI3_OLMO2_RELEASED.items()}
)


@pytest.mark.parametrize("name", list(PHI3_OLMO2_RELEASED))
def test_phi3_and_olmo2_sizes_are_the_released_configs(name: str) -> None:
    """Each size is its released config, its count rounds to the published total, and it is the
    family's variant (Phi-3: fused projections, the mini's window 2047; OLMo 2: norms after each
    sub-block, q/k norms over the projections)."""
    shape, published = PHI3_OLMO2_RELEASED[name]
    olmo = name.startswith("olmo")
    cfg = ModelConfig.named(name)
    assert f"{_phi3_olmo2_count(*shape, olmo) / 1e9:.1f}B" == published
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == shape[:4]
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.tie_embeddings) == (*shape[4:], False)
    variant = (cfg.fused_projections, cfg.post_norm, cfg.qk_norm, cfg.qk_norm_scope)
    assert variant == ((False, True, True, "projection") if olmo else (True, False, False, "head"))
    assert cfg.hf_model_type == ("olmo2" if olmo else "phi3")
    assert cfg.sliding_window == (2047 if name == "phi-3-mini" else 0)
    assert cfg.rope_theta == {"phi-3-mini": 1e4, "phi-4": 2.5e5}.get(name, 5e5)


def _granite_count(
    hidden: int, layers: int, heads: int, kv: int, experts: int, width: int, vocab: int
) -> tuple[int, int]:
    """(total, per token less the embedding) parameters of a Granite 3.1 checkpoint from its
    config.json's numbers, written out from transformers' GraniteMoeForCausalLM (per layer q, k, v, o,
    the router (E, D), input_linear (E, 2F, D), output_linear (E, D, F), two RMSNorms of the width) and
    GraniteForCausalLM (experts=0: gate, up (F, D), down (D, F)); the tied embedding, the final norm.
    Per token: the top 8 experts."""
    q, k = hidden, kv * (hidden // heads)
    attention = hidden * q + 2 * hidden * k + q * hidden + 2 * hidden
    mlp = 3 * hidden * width
    total = vocab * hidden + hidden + layers * (attention + (experts * (hidden + mlp) if experts else mlp))
    active = hidden + layers * (attention + (experts * hidden + 8 * mlp if experts else mlp))
    return total, active


# The Granite 3.1 configs (ibm-granite/granite-3.1-1b-a400m-*, -3b-a800m-*, -8b-*: hidden_size,
# num_hidden_layers, num_attention_heads, num_key_value_heads, num_local_experts, intermediate_size,
# vocab_size; all tied), their counts, and the figures their names publish (3B total, 800M active).
# The counts are these shapes', derived here: no card publishes them to the parameter.
GRANITE_RELEASED = {
    "granite-3.1-1b-a400m": ((1024, 24, 16, 8, 32, 512, 49155), 1_334_628_352, "1B", "400M"),
    "granite-3.1-3b-a800m": ((1536, 32, 24, 8, 40, 512, 49155), 3_298_793_472, "3B", "800M"),
    "granite-3.1-8b": ((4096, 40, 32, 8, 0, 12800, 49155), 8_170_848_256, "8B", ""),
}
PUBLISHED_COUNTS.update({name: count for name, (_, count, _, _) in GRANITE_RELEASED.items()})


@pytest.mark.parametrize("name", list(GRANITE_RELEASED))
def test_granite_sizes_are_the_released_configs(name: str) -> None:
    """Each Granite size is its released config: the count of the config's numbers is the named
    size's and rounds to its name's figures; it has Granite's four scalars (attention_multiplier
    1/head_dim) and, for the MoE sizes, 8 of its experts per token, which its FLOPs count."""
    shape, count, total_name, active_name = GRANITE_RELEASED[name]
    hidden, layers, heads, kv, experts, width, vocab = shape
    cfg = ModelConfig.named(name)
    total, active = _granite_count(*shape)
    assert total == count == param_count(cfg)
    assert f"{total / 1e9:.0f}B" == total_name
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == shape[:4] + (
        vocab,
    )
    assert (cfg.num_experts, cfg.tie_embeddings, cfg.hf_model_type) == (
        experts,
        True,
        "granitemoe" if experts else "granite",
    )
    assert (cfg.moe_intermediate_size if experts else cfg.intermediate_size) == width
    scalars = (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attention_multiplier)
    assert scalars == (12.0, 0.22, 1 / cfg.head_dim)
    assert cfg.logits_scaling == (6.0 if experts else 16.0)
    assert cfg.rope_theta == (1.5e6 if name == "granite-3.1-1b-a400m" else 1e7)
    # FLOPs: 6 per multiplied weight (the embedding is a lookup, the norms no matmul; tied head counted).
    assert matmul_param_count(cfg) == active - hidden - 2 * hidden * layers + vocab * hidden
    if experts:
        assert cfg.num_experts_per_tok == 8
        assert f"{active / 1e8:.0f}00M" == active_name


def test_gemma3_attention_flops_count_each_local_layer_over_its_window():
    cfg = ModelConfig.named("gemma-3-12b")  # 48 layers: 8 global, 40 within 1024 positions
    width, seq = cfg.num_heads * cfg.head_dim, 8192
    want = 6 * matmul_param_count(cfg) + 12 * width * (8 * seq + 40 * 1024)
    assert flops_per_token(cfg, seq) == want
    assert flops_per_token(cfg, 512) == 6 * matmul_param_count(cfg) + 12 * width * 48 * 512


def test_phi3_mini_trains_past_its_window_and_counts_each_layer_over_it():
    """Phi-3-mini-4k windows every layer to 2,047 positions: a 4,096-token run is accepted (transformers
    computes the same window: tests/test_hf.py), and its attention FLOPs count the window."""
    from jaxzero import parse_args

    cfg = parse_args(["--model.name=phi-3-mini", "--data.seq_len=4096"]).model
    width, seq = cfg.num_heads * cfg.head_dim, 4096
    assert flops_per_token(cfg, seq) == 6 * matmul_param_count(cfg) + 12 * width * cfg.num_layers * 2047


@pytest.mark.parametrize("name", list(QWEN3_RELEASED))
def test_qwen3_sizes_are_the_released_configs(name: str) -> None:
    """Each qwen3 size is its released config, and its count rounds to the published figures (the
    total, and the count without the embedding and the untied head)."""
    (hidden, layers, heads, kv, head_dim, mlp, vocab, tie), total, non_embedding = QWEN3_RELEASED[name]
    cfg = ModelConfig.named(name)
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        hidden,
        layers,
        heads,
        kv,
        head_dim,
    )
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.tie_embeddings) == (mlp, vocab, tie)
    assert (cfg.qk_norm, cfg.attention_bias, cfg.hf_model_type, cfg.rope_theta, cfg.norm_eps) == (
        True,
        False,
        "qwen3",
        1e6,
        1e-6,
    )
    count = param_count(cfg)
    embeddings = vocab * hidden * (1 if tie else 2)
    for n, published in ((count, total), (count - embeddings, non_embedding)):
        digits = len(published.split(".")[1]) - 1  # as many as the card gives
        assert f"{n / 1e9:.{digits}f}B" == published


def _eval_shape_count(cfg: ModelConfig) -> int:
    shapes = jax.eval_shape(build_model(cfg).init, jax.random.key(0))
    assert all(s.dtype == jnp.float32 for s in jax.tree.leaves(shapes))
    return sum(math.prod(s.shape) for s in jax.tree.leaves(shapes))


@pytest.mark.parametrize("name", list(PUBLISHED_COUNTS))
def test_published_param_counts(name: str) -> None:
    cfg = ModelConfig.named(name)
    assert param_count(cfg) == PUBLISHED_COUNTS[name]
    assert _eval_shape_count(cfg) == PUBLISHED_COUNTS[name]  # eval_shape allocates nothing


def test_every_named_size_is_covered() -> None:
    assert set(NAMED_SIZES) == set(PUBLISHED_COUNTS) | {"llama-tiny", "gpt2-tiny"}
    for name, cfg in NAMED_SIZES.items():
        assert cfg.name == name


def test_tiny_sizes() -> None:
    assert ModelConfig.named("llama-tiny") == ModelConfig()
    g = ModelConfig.named("gpt2-tiny")
    shape = (
        g.family,
        g.vocab_size,
        g.hidden_size,
        g.num_layers,
        g.num_heads,
        g.num_kv_heads,
        g.intermediate_size,
        g.max_seq_len,
        g.tie_embeddings,
    )
    assert shape == ("gpt2", 256, 128, 4, 4, 4, 512, 1024, True)


@pytest.mark.parametrize(
    "cfg",
    [
        ModelConfig.named("llama-tiny"),
        ModelConfig.named("gpt2-tiny"),
        LLAMA_SMALL,
        LLAMA_SMALL_TIED,
        GPT2_SMALL,
    ],
    ids=lambda c: c.name,
)
def test_param_count_matches_init(cfg: ModelConfig) -> None:
    assert param_count(cfg) == _eval_shape_count(cfg)
    shapes = jax.eval_shape(build_model(cfg).init, jax.random.key(0))

    def count(tree: Any) -> int:
        return sum(math.prod(s.shape) for s in jax.tree.leaves(tree))

    n_embed, n_block, n_head = unit_param_counts(cfg)
    assert (count(shapes.embed), count(shapes.head)) == (n_embed, n_head)
    assert all(count(b) == n_block for b in shapes.blocks)


def test_flops_per_token_by_hand() -> None:
    # llama-tiny: D=128, L=4, N=4, K=2, head_dim=32, F=384, V=256.
    #   per block: q 128*128 + k 128*64 + v 128*64 + o 128*128 + mlp 3*128*384 = 196,608
    #   matmul params: 4 * 196,608 + head 128*256 = 819,200
    #   at S=128: 6 * 819,200 + 12 * 4 * 128 * 128 = 4,915,200 + 786,432 = 5,701,632
    llama = ModelConfig.named("llama-tiny")
    assert matmul_param_count(llama) == 819_200
    assert flops_per_token(llama, 128) == 5_701_632.0
    # Tying does not change FLOPs: the head still multiplies by a (D, V) matrix.
    assert flops_per_token(dataclasses.replace(llama, tie_embeddings=True), 128) == 5_701_632.0
    # gpt2-tiny: per block c_attn 128*384 + c_proj 128*128 + c_fc 128*512 + c_proj 512*128 = 196,608;
    #   at S=64: 6 * 819,200 + 12 * 4 * 128 * 64 = 4,915,200 + 393,216 = 5,308,416 (biases, wpe excluded).
    assert flops_per_token(ModelConfig.named("gpt2-tiny"), 64) == 5_308_416.0
    # Llama 2 7B at 4096: 32 * (4 * 4096^2 + 3 * 4096 * 11008) + 4096 * 32000 = 6,607,077,376 matmul
    #   params; 6 * that + 12 * 32 * 4096 * 4096 = 39,642,464,256 + 6,442,450,944.
    assert flops_per_token(ModelConfig.named("llama-7b"), 4096) == 46_084_915_200.0


def test_unknown_name_lists_valid_names() -> None:
    with pytest.raises(ConfigError) as err:
        ModelConfig.named("llama-9000b")
    msg = str(err.value)
    assert "llama-9000b" in msg
    for name in NAMED_SIZES:
        assert name in msg

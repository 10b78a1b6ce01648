"""gpt-oss's attention with sinks (`jaxzero.models.sinks`): the banded local layers and the cuDNN
form of the global ones (its prepended sink key run through XLA here, the same computation the GPU
kernel is handed) against the dense float32 reference, outputs and every gradient (the sinks' too);
the per-layer switch; and a gpt-oss model through the switch against the dense path."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxzero.config import ConfigError, ModelConfig
from jaxzero.models import build_model, forward, gpt_oss, sinks
from jaxzero.models.gemma import NO_WINDOW

F32_TOL = 1e-5
BF16_TOL = 2e-2  # tests/test_models.py: bfloat16 outputs against float64


def small_gpt_oss(**fields) -> ModelConfig:
    """gpt-oss-20b's blocks cut small: 4 layers, local (window 6) and global alternating, 4 heads of
    16 over 2 key/value heads, 4 experts of width 16, top 2."""
    return ModelConfig.named(
        "gpt-oss-20b", vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2,
        head_size=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        intermediate_size=16, sliding_window=6, **fields,
    )  # fmt: skip


def rel(a: jax.Array, b: jax.Array) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def inputs(b: int, s: int, n: int, kv: int, h: int, dtype=jnp.float32, seed: int = 0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(ks[0], (b, s, n, h)).astype(dtype)
    k = jax.random.normal(ks[1], (b, s, kv, h)).astype(dtype)
    v = jax.random.normal(ks[2], (b, s, kv, h)).astype(dtype)
    sk = (2.0 * jax.random.normal(ks[3], (n,))).astype(dtype)  # some heads mostly read the sink
    ct = jax.random.normal(ks[4], (b, s, n, h))
    return (q, k, v, sk), ct


def dense(window: int, scale: float):
    def f(q, k, v, sk):
        pos = jnp.arange(q.shape[1])
        return sinks.sink_attention(q, k, v, sk, sinks.window_mask(pos, pos, window)[None], scale)

    return f


def out_and_grads(f, args, ct):
    """f's output and the gradients of <f(args), ct> in q, k, v and the sinks."""
    out, vjp = jax.vjp(f, *args)
    return (out, *vjp(ct.astype(out.dtype)))


def reference64(q, k, v, sk, window: int, scale: float) -> np.ndarray:
    """float64 NumPy: softmax over the window's keys and the head's sink, which reads no value."""
    q, k, v, sk = (np.asarray(t, np.float64) for t in (q, k, v, sk))
    b, s, n, h = q.shape
    g = n // k.shape[2]
    k, v = np.repeat(k, g, 2), np.repeat(v, g, 2)
    scores = np.einsum("bind,bjnd->bnij", q, k) * scale
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    scores = np.where(((j <= i) & (i - j < window))[None, None], scores, -np.inf)
    full = np.concatenate([scores, np.broadcast_to(sk[None, :, None, None], (b, n, s, 1))], -1)
    p = np.exp(full - full.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    return np.einsum("bnij,bjnd->bind", p[..., :-1], v)


@pytest.mark.parametrize(
    "shape, window",
    [((2, 37, 4, 2, 16), 8), ((1, 64, 6, 3, 32), 16), ((2, 24, 4, 4, 16), 40)],
    ids=["ragged-last-block", "blocks-divide", "window-past-sequence"],
)
def test_banded_local_layer_is_the_dense_window(shape, window) -> None:
    """Blocks of `window` queries over their own and the previous block's keys: every output and
    gradient of the dense windowed mask, off by one key or across a block's edge it is not."""
    b, s, n, kv, h = shape
    args, ct = inputs(b, s, n, kv, h)
    scale = h**-0.5
    want = out_and_grads(dense(window, scale), args, ct)
    got = out_and_grads(lambda *a: sinks.banded_sink_attention(*a, window, scale), args, ct)
    for name, x, y in zip(("out", "dq", "dk", "dv", "dsinks"), got, want, strict=True):
        assert rel(x, y) < F32_TOL, name
    assert rel(got[0], reference64(*args, window, scale)) < F32_TOL
    # a window one key wider or narrower is another function
    for other in (window - 1, window + 1):
        if other < s:
            assert rel(got[0], dense(other, scale)(*args)) > 1e-3


@pytest.mark.parametrize("scale", [0.25, 0.0771], ids=["power-of-two", "any-scale"])
def test_prepended_sink_key_is_causal_attention_with_sinks(scale: float) -> None:
    """The global layer's form for cuDNN (a zero query and the sink key in front, the sink's logit in
    two extra head dimensions), run through XLA: the dense causal reference, outputs and gradients,
    grouped-query heads each with its own sink."""
    args, ct = inputs(2, 33, 8, 2, 24)
    assert sinks.augmented_head_dim(24) == 32 and sinks.augmented_head_dim(64) == 72
    want = out_and_grads(dense(NO_WINDOW, scale), args, ct)
    got = out_and_grads(lambda *a: sinks.cudnn_sink_attention(*a, scale, "xla"), args, ct)
    for name, x, y in zip(("out", "dq", "dk", "dv", "dsinks"), got, want, strict=True):
        assert rel(x, y) < F32_TOL, name


def test_bfloat16_paths_against_float64() -> None:
    """In bfloat16 (the GPU's dtype) each path is within the model tests' bfloat16 tolerance of the
    float64 reference; the sink's logit keeps its bits through the hi + lo pair at any scale."""
    args, _ = inputs(1, 96, 8, 2, 64, jnp.bfloat16, seed=3)
    scale = 0.0771
    for window, f in [
        (32, lambda *a: sinks.banded_sink_attention(*a, 32, scale)),
        (NO_WINDOW, lambda *a: sinks.cudnn_sink_attention(*a, scale, "xla")),
    ]:
        want = reference64(*args, window, scale)
        assert rel(f(*args), want) < BF16_TOL
        assert rel(f(*args), want) <= 1.5 * rel(dense(window, scale)(*args), want) + 1e-3


def test_the_switch_takes_each_layers_window() -> None:
    """One program, the window traced: the local window (banded) and a window at or past the
    sequence (the prepended sink key) each equal the dense mask of that window."""
    args, ct = inputs(2, 40, 4, 2, 16)
    scale = 0.25
    run = jax.jit(
        lambda w, *a: sinks.windowed_sink_attention(*a, window=w, local_window=8, scale=scale, impl="xla")
    )
    for window in (8, NO_WINDOW, 40):
        want = out_and_grads(dense(window, scale), args, ct)
        got = out_and_grads(functools.partial(run, jnp.int32(window)), args, ct)
        for name, x, y in zip(("out", "dq", "dk", "dv", "dsinks"), got, want, strict=True):
            assert rel(x, y) < F32_TOL, (window, name)
    # a model without local layers (window "none"), or a run no longer than its window: causal
    for local in (NO_WINDOW, 40):
        got = sinks.windowed_sink_attention(
            *args, window=jnp.int32(local), local_window=local, scale=scale, impl="xla"
        )
        assert rel(got, dense(NO_WINDOW, scale)(*args)) < F32_TOL


def test_gpt_oss_through_the_switch_is_the_dense_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A gpt-oss model of local and global layers whose attention resolves to cuDNN runs the
    switch with each layer's window (here with XLA inside, the same computation): its logits and
    parameter gradients are the dense path's. Packed documents keep the dense mask."""
    model = build_model(small_gpt_oss(compute_dtype="float32"))
    params = model.init(jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 21), 0, 64)

    def loss(p):
        return jnp.mean(forward(model, p, tokens) ** 2)

    want = jax.value_and_grad(loss)(params)
    seen = []

    def switch(*a, **kw):
        seen.append(kw["local_window"])
        return sinks.windowed_sink_attention(*a, **{**kw, "impl": "xla"})

    monkeypatch.setattr(gpt_oss.layers, "resolve_attention_impl", lambda *a: "cudnn")
    monkeypatch.setattr(gpt_oss, "windowed_sink_attention", switch)
    got = jax.value_and_grad(loss)(params)
    assert seen and set(seen) == {6}
    assert rel(got[0], want[0]) < F32_TOL
    for x, y in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        assert rel(x, y) < F32_TOL


def test_cudnn_without_a_gpu_is_refused_by_name() -> None:
    """model.attention_impl=cudnn on a CPU: the reason, not a lowering error."""
    model = build_model(small_gpt_oss(attention_impl="cudnn", compute_dtype="bfloat16"))
    with pytest.raises(ConfigError, match="model.attention_impl=cudnn cannot be used: the default JAX"):
        jax.eval_shape(model.init, jax.random.PRNGKey(0))


def test_the_plan_counts_what_each_path_holds() -> None:
    """The memory plan's block transient: XLA's two float32 (rows, heads, S, S) arrays, cuDNN's
    path's two (rows, heads, S, 2 * window) of its local layers in their place (the plan is for the
    GPU, where `auto` takes cuDNN's path)."""
    from jaxzero.planner.memory import transient_activations

    xla, auto, cudnn = (
        ModelConfig.named("gpt-oss-20b", attention_impl=impl) for impl in ("xla", "auto", "cudnn")
    )
    rows, s, heads, window = 8, 2048, xla.num_heads, xla.sliding_window
    dense = transient_activations(xla, rows * s, s).block
    banded = transient_activations(cudnn, rows * s, s).block
    assert dense - banded == 2 * rows * heads * s * (s - 2 * window) * 4
    assert transient_activations(auto, rows * s, s).block == banded  # a GPU's auto: cuDNN's path
    f32_auto, f32_xla = (
        ModelConfig.named("gpt-oss-20b", compute_dtype="float32", attention_impl=impl)
        for impl in ("auto", "xla")
    )  # in float32 `auto` resolves to XLA (cuDNN needs bf16): the dense arrays
    assert transient_activations(f32_auto, rows * s, s) == transient_activations(f32_xla, rows * s, s)

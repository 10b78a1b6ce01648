"""The mixture-of-experts layer (jaxzero.models.moe) against references that share none of its code:
a per-token loop in float64 NumPy, transformers' own sparse MoE blocks and load-balancing loss, and a
dense-gather JAX reference for gradients. Both groupings (ragged_dot, padded blocks) are checked."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxzero.models import moe

RTOL32 = 2e-5  # relative error (max |a - b| / max |b|) allowed of float32 against float64 / torch float32

SPECS = {
    "mixtral": moe.mixtral_spec(num_experts=4, top_k=2),
    "qwen3_moe": moe.qwen3_moe_spec(num_experts=8, top_k=3, norm_topk_prob=True),
    "qwen3_moe_unnormalised": moe.qwen3_moe_spec(num_experts=8, top_k=3, norm_topk_prob=False),
    "gpt_oss": moe.gpt_oss_spec(num_experts=6, top_k=2, swiglu_alpha=1.702, swiglu_limit=0.05),
    # Granite's softmax over its top-k logits, computed as Mixtral's renormalised top-k of the softmax
    # (`jaxzero.models.llama.moe_spec`): transformers' GraniteMoeMoE is the reference.
    "granitemoe": moe.mixtral_spec(num_experts=5, top_k=3),
}
EXPERTS_FNS = {
    "ragged_dot": moe.experts_ragged_dot,
    "padded": moe.experts_padded,
    "padded_block3": functools.partial(moe.experts_padded, block_rows=3),
    "padded_block64": functools.partial(moe.experts_padded, block_rows=64),
}
D, F = 16, 12


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def random_params(spec: moe.MoeSpec, seed: int = 0) -> dict:
    """Random float32 parameters of the documented layout, biases nonzero (init_moe zeroes them)."""
    params = moe.init_moe(jax.random.key(seed), spec, D, F, std=0.3)
    if spec.bias:
        keys = jax.random.split(jax.random.key(seed + 1), 3)
        for key, name in zip(keys, ("router", "gate_up", "down"), strict=True):
            shape = params[name]["bias"].shape
            params[name]["bias"] = 0.3 * jax.random.normal(key, shape, jnp.float32)
    return params


def tokens(T: int, seed: int = 2) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), (T, D), jnp.float32)


# ---------------------------------------------------------------------------------------------------
# A per-token reference in float64 NumPy
# ---------------------------------------------------------------------------------------------------


def np_activation(h: np.ndarray, spec: moe.MoeSpec) -> np.ndarray:
    """(2F,) [gate | up] -> (F,): silu(gate) * up, or gpt-oss's clamped SwiGLU."""
    gate, up = h[:F], h[F:]
    if spec.activation == "swiglu":
        return gate / (1 + np.exp(-gate)) * up
    gate = np.minimum(gate, spec.swiglu_limit)
    up = np.clip(up, -spec.swiglu_limit, spec.swiglu_limit)
    return (up + 1) * gate / (1 + np.exp(-spec.swiglu_alpha * gate))


def reference_block(params: dict, x: np.ndarray, spec: moe.MoeSpec) -> tuple[np.ndarray, np.ndarray]:
    """(y (T, D), logits (T, E)), token by token, from the family's published definition."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    x = np.asarray(x, np.float64)
    logits = x @ p["router"]["kernel"] + (p["router"]["bias"] if spec.bias else 0.0)
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        if spec.router == "softmax_topk":
            probs = np.exp(logits[t] - logits[t].max())
            probs /= probs.sum()
            chosen = np.argsort(-probs, kind="stable")[: spec.top_k]
            w = probs[chosen] / (probs[chosen].sum() if spec.normalize else 1.0)
        else:
            chosen = np.argsort(-logits[t], kind="stable")[: spec.top_k]
            w = np.exp(logits[t][chosen] - logits[t][chosen].max())
            w /= w.sum()
        for e, we in zip(chosen, w, strict=True):
            h = x[t] @ p["gate_up"]["kernel"][e] + (p["gate_up"]["bias"][e] if spec.bias else 0.0)
            out = np_activation(h, spec) @ p["down"]["kernel"][e] + (
                p["down"]["bias"][e] if spec.bias else 0.0
            )
            y[t] += we * out
    return y, logits


@pytest.mark.parametrize("family", list(SPECS))
@pytest.mark.parametrize("fn", list(EXPERTS_FNS))
def test_block_equals_a_per_token_float64_reference(family, fn):
    spec = SPECS[family]
    params = random_params(spec)
    x = tokens(37)
    y, routing = jax.jit(functools.partial(moe.moe_block, spec=spec, experts_fn=EXPERTS_FNS[fn]))(params, x)
    y_ref, logits_ref = reference_block(params, x, spec)
    assert y.shape == x.shape and y.dtype == jnp.float32
    assert routing.weights.dtype == jnp.float32 and routing.experts.dtype == jnp.int32
    assert rel_err(routing.logits, logits_ref) < RTOL32
    assert rel_err(y, y_ref) < RTOL32, rel_err(y, y_ref)


def test_leading_axes_are_flattened_into_tokens():
    spec = SPECS["qwen3_moe"]
    params = random_params(spec)
    x = tokens(12)
    block = jax.jit(functools.partial(moe.moe_block, spec=spec))
    y, routing = block(params, x.reshape(3, 4, D))
    y_flat, _ = block(params, x)
    assert y.shape == (3, 4, D) and routing.logits.shape == (12, spec.num_experts)
    np.testing.assert_array_equal(np.asarray(y).reshape(12, D), np.asarray(y_flat))


# ---------------------------------------------------------------------------------------------------
# transformers' own modules
# ---------------------------------------------------------------------------------------------------


def hf_block(family: str, spec: moe.MoeSpec):
    """transformers' sparse MoE block of `family` with torch random weights, and those weights in
    jaxzero's layout."""
    torch.manual_seed(0)
    if family == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        config = MixtralConfig(
            hidden_size=D,
            intermediate_size=F,
            num_local_experts=spec.num_experts,
            num_experts_per_tok=spec.top_k,
        )
        config._experts_implementation = "eager"
        block, router = MixtralSparseMoeBlock(config), "gate"
    elif family.startswith("qwen3_moe"):
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        config = Qwen3MoeConfig(
            hidden_size=D,
            moe_intermediate_size=F,
            num_experts=spec.num_experts,
            num_experts_per_tok=spec.top_k,
            norm_topk_prob=spec.normalize,
        )
        config._experts_implementation = "eager"
        block, router = Qwen3MoeSparseMoeBlock(config), "gate"
    elif family == "granitemoe":
        from transformers import GraniteMoeConfig
        from transformers.models.granitemoe.modeling_granitemoe import GraniteMoeMoE

        config = GraniteMoeConfig(
            hidden_size=D,
            intermediate_size=F,
            num_local_experts=spec.num_experts,
            num_experts_per_tok=spec.top_k,
        )
        config._experts_implementation = "eager"
        block, router = GraniteMoeMoE(config), "router"
    else:
        from transformers import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

        config = GptOssConfig(
            hidden_size=D,
            intermediate_size=F,
            num_local_experts=spec.num_experts,
            num_experts_per_tok=spec.top_k,
            swiglu_limit=spec.swiglu_limit,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
        )
        config._experts_implementation = "eager"
        block, router = GptOssMLP(config), "router"
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.3)
    sd = {k: v.detach().numpy() for k, v in block.state_dict().items()}
    gu, down = sd["experts.gate_up_proj"], sd["experts.down_proj"]
    if spec.bias:  # (E, D, 2F) interleaved gate/up -> [gate | up]; down (E, F, D) as is
        gu_bias = sd["experts.gate_up_proj_bias"]
        params = {
            "router": {"kernel": sd["router.weight"].T, "bias": sd["router.bias"]},
            "gate_up": {
                "kernel": np.concatenate([gu[..., ::2], gu[..., 1::2]], axis=-1),
                "bias": np.concatenate([gu_bias[..., ::2], gu_bias[..., 1::2]], axis=-1),
            },
            "down": {"kernel": down, "bias": sd["experts.down_proj_bias"]},
        }
    else:  # (E, 2F, D) [gate; up] -> (E, D, 2F); (E, D, F) -> (E, F, D)
        params = {
            "router": {"kernel": sd["router.weight" if family == "granitemoe" else "gate.weight"].T},
            "gate_up": {"kernel": gu.transpose(0, 2, 1)},
            "down": {"kernel": down.transpose(0, 2, 1)},
        }
    return block, getattr(block, router), jax.tree.map(jnp.asarray, params)


@pytest.mark.parametrize("family", list(SPECS))
def test_block_equals_transformers_module(family):
    spec = SPECS[family]
    block, router, params = hf_block(family, spec)
    x = np.array(tokens(2 * 9), np.float32).reshape(2, 9, D)
    with torch.no_grad():
        out = block(torch.from_numpy(x))
        y_hf = (out[0] if isinstance(out, tuple) else out).numpy()
        logits_hf = router(torch.from_numpy(x).reshape(-1, D))[0].numpy()
    for fn in (moe.experts_ragged_dot, moe.experts_padded):
        y, routing = jax.jit(functools.partial(moe.moe_block, spec=spec, experts_fn=fn))(
            params, jnp.asarray(x)
        )
        assert rel_err(routing.logits, logits_hf) < RTOL32
        assert rel_err(y, y_hf) < RTOL32, (fn.__name__, rel_err(y, y_hf))


# ---------------------------------------------------------------------------------------------------
# The load-balancing loss
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss", "granitemoe"])
@pytest.mark.parametrize("masked", [False, True])
def test_load_balancing_loss_and_its_gradient_equal_transformers(family, masked):
    from transformers.models.granitemoe import modeling_granitemoe
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    if family == "granitemoe":  # its own copy of the function
        load_balancing_loss_func = modeling_granitemoe.load_balancing_loss_func

    spec = SPECS[family]
    B, S, L, E = 2, 5, 3, spec.num_experts
    rng = np.random.default_rng(3)
    logits = [rng.normal(size=(B * S, E)).astype(np.float32) for _ in range(L)]
    mask = (rng.random((B, S)) > 0.3).astype(np.int64) if masked else None

    def loss(layer_logits):
        m = None if mask is None else jnp.asarray(mask.reshape(-1))
        stats = [moe.router_stats(moe.route_logits(lg, spec), m) for lg in layer_logits]
        return moe.load_balancing_loss(moe.sum_stats(stats))

    value, grads = jax.jit(jax.value_and_grad(loss))([jnp.asarray(lg) for lg in logits])
    torch_logits = tuple(torch.tensor(lg, requires_grad=True) for lg in logits)
    hf = load_balancing_loss_func(
        torch_logits, E, spec.top_k, None if mask is None else torch.from_numpy(mask)
    )
    hf.backward()
    assert rel_err(value, hf.detach().numpy()) < RTOL32
    # Not the sum of per-layer losses: the statistics are pooled before the product.
    per_layer = sum(float(jax.jit(loss)([jnp.asarray(lg)])) for lg in logits)
    assert abs(per_layer - float(value)) > 1e-3
    for g, t in zip(grads, torch_logits, strict=True):
        assert rel_err(g, t.grad.numpy()) < RTOL32


def test_router_stats_count_every_assignment_of_unmasked_tokens():
    spec = SPECS["qwen3_moe"]
    routing = moe.route_logits(jnp.asarray(np.random.default_rng(4).normal(size=(7, 8)), jnp.float32), spec)
    mask = jnp.asarray([1, 1, 0, 1, 0, 1, 1], jnp.float32)
    stats = moe.router_stats(routing, mask)
    assert float(stats.rows) == 5.0 and float(jnp.sum(stats.counts)) == 5.0 * spec.top_k
    np.testing.assert_allclose(float(jnp.sum(stats.prob_sum)), 5.0, rtol=1e-6)


# ---------------------------------------------------------------------------------------------------
# Gradients, empty groups, zero weights
# ---------------------------------------------------------------------------------------------------


def dense_gather_block(params: dict, x: jax.Array, spec: moe.MoeSpec) -> jax.Array:
    """Each (token, slot) gathers its expert's kernels: jnp, no sorting, no grouped matmul."""
    logits = x @ params["router"]["kernel"] + (params["router"]["bias"][None, :] if spec.bias else 0.0)
    if spec.router == "softmax_topk":
        w, e = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), spec.top_k)
        w = w / jnp.sum(w, axis=-1, keepdims=True) if spec.normalize else w
    else:
        top, e = jax.lax.top_k(logits, spec.top_k)
        w = jax.nn.softmax(top, axis=-1)
    h = jnp.einsum("td,tkdf->tkf", x, params["gate_up"]["kernel"][e])
    if spec.bias:
        h = h + params["gate_up"]["bias"][e]
    a = moe.activation(h, spec)
    out = jnp.einsum("tkf,tkfd->tkd", a, params["down"]["kernel"][e])
    if spec.bias:
        out = out + params["down"]["bias"][e]
    return jnp.sum(out * w[:, :, None], axis=1)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe_unnormalised", "gpt_oss"])
def test_gradients_equal_a_dense_gather_reference(family):
    spec = SPECS[family]
    params = random_params(spec)
    x = tokens(21)
    cot = jax.random.normal(jax.random.key(9), x.shape, jnp.float32)

    def loss(block, params, x):
        return jnp.sum(block(params, x) * cot)

    reference = functools.partial(loss, functools.partial(dense_gather_block, spec=spec))
    want = jax.jit(jax.grad(reference, (0, 1)))(params, x)
    assert float(jnp.max(jnp.abs(want[0]["router"]["kernel"]))) > 0  # the router is trained
    for fn in (moe.experts_ragged_dot, functools.partial(moe.experts_padded, block_rows=4)):
        block = lambda p, x, fn=fn: moe.moe_block(p, x, spec, experts_fn=fn)[0]  # noqa: E731
        got = jax.jit(jax.grad(functools.partial(loss, block), (0, 1)))(params, x)
        for path, g in jax.tree_util.tree_leaves_with_path(got):
            w = functools.reduce(lambda t, k: t[k.key if hasattr(k, "key") else k.idx], path, want)
            assert rel_err(g, w) < RTOL32, (jax.tree_util.keystr(path), rel_err(g, w))


@pytest.mark.parametrize("fn", list(EXPERTS_FNS))
def test_empty_experts_and_a_token_with_zero_weights(fn):
    """Experts 1, 3 and 5 receive no token; token 0's weights are zero (routed nowhere): its output and
    its gradients are zero, and the empty experts' kernels get zero gradients."""
    spec = SPECS["gpt_oss"]
    params = random_params(spec)
    x = tokens(5)
    experts = jnp.asarray([[0, 2], [2, 4], [4, 0], [0, 2], [2, 4]], jnp.int32)
    weights = jax.nn.softmax(jax.random.normal(jax.random.key(5), (5, 2)), axis=-1).at[0].set(0.0)
    run = functools.partial(EXPERTS_FNS[fn], spec=spec)
    y = jax.jit(run)(params, x, weights, experts)
    p64 = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    for t in range(1, 5):
        want = np.zeros(D)
        for e, w in zip(np.asarray(experts[t]), np.asarray(weights[t], np.float64), strict=True):
            h = np.asarray(x[t], np.float64) @ p64["gate_up"]["kernel"][e] + p64["gate_up"]["bias"][e]
            want += w * (np_activation(h, spec) @ p64["down"]["kernel"][e] + p64["down"]["bias"][e])
        assert rel_err(y[t], want) < RTOL32
    np.testing.assert_array_equal(np.asarray(y[0]), 0.0)
    gp, gx = jax.jit(jax.grad(lambda p, x: jnp.sum(run(p, x, weights, experts) ** 2), (0, 1)))(params, x)
    np.testing.assert_array_equal(np.asarray(gx[0]), 0.0)
    for name in ("gate_up", "down"):
        for leaf in ("kernel", "bias"):
            g = np.asarray(gp[name][leaf])
            np.testing.assert_array_equal(g[[1, 3, 5]], 0.0)
            assert np.all(np.any(g[[0, 2, 4]] != 0, axis=tuple(range(1, g.ndim))))


def test_one_token_and_all_tokens_on_one_expert_group():
    spec = moe.qwen3_moe_spec(num_experts=8, top_k=1, norm_topk_prob=False)
    params = random_params(spec)
    x = tokens(6)
    experts = jnp.full((6, 1), 7, jnp.int32)
    weights = jnp.ones((6, 1), jnp.float32)
    ragged_dot = jax.jit(functools.partial(moe.experts_ragged_dot, spec=spec))
    ragged = ragged_dot(params, x, weights, experts)
    for B in (1, 4, 256):
        padded = jax.jit(functools.partial(moe.experts_padded, spec=spec, block_rows=B))
        assert rel_err(padded(params, x, weights, experts), ragged) < RTOL32
    y1 = ragged_dot(params, x[:1], weights[:1], experts[:1])
    assert rel_err(y1, ragged[:1]) < RTOL32


def test_bfloat16_groupings_agree_and_stay_in_bfloat16():
    spec = SPECS["qwen3_moe"]
    params = random_params(spec)
    x = tokens(40).astype(jnp.bfloat16)
    y_r, routing = jax.jit(functools.partial(moe.moe_block, spec=spec, experts_fn=moe.experts_ragged_dot))(
        params, x
    )
    y_p, _ = jax.jit(functools.partial(moe.moe_block, spec=spec, experts_fn=moe.experts_padded))(params, x)
    assert y_r.dtype == y_p.dtype == jnp.bfloat16 and routing.logits.dtype == jnp.float32
    assert rel_err(y_p, y_r) < 2e-2


def test_bad_spec_and_mismatched_router_are_refused():
    with pytest.raises(ValueError, match="top_k=9"):
        moe.qwen3_moe_spec(num_experts=8, top_k=9, norm_topk_prob=True)
    params = random_params(SPECS["mixtral"])
    with pytest.raises(ValueError, match="num_experts=8"):
        moe.moe_block(params, tokens(3), SPECS["qwen3_moe"])


def test_a_grouped_matmul_passed_in_replaces_ragged_dot():
    """`matmul` of ragged_dot's contract (here each row gathers its expert's kernel) is what runs."""
    spec = SPECS["mixtral"]
    params = random_params(spec)
    x = tokens(9)
    calls = []

    def gathered(rows, kernels, group_sizes):
        calls.append(rows.shape)
        expert_of_row = jnp.repeat(
            jnp.arange(kernels.shape[0]), group_sizes, total_repeat_length=rows.shape[0]
        )
        return jnp.einsum("ni,nio->no", rows, kernels[expert_of_row])

    fn = functools.partial(moe.experts_ragged_dot, matmul=gathered)
    y, _ = jax.jit(functools.partial(moe.moe_block, spec=spec, experts_fn=fn))(params, x)
    assert calls == [(9 * 2, D), (9 * 2, F)]
    assert rel_err(y, reference_block(params, x, spec)[0]) < RTOL32


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_parameter_counts_follow_the_shapes(family):
    spec = SPECS[family]
    params = moe.init_moe(jax.random.key(0), spec, D, F)
    assert moe.param_count(spec, D, F) == sum(leaf.size for leaf in jax.tree.leaves(params))
    one_expert = params["gate_up"]["kernel"][0].size + params["down"]["kernel"][0].size
    active = params["router"]["kernel"].size + spec.top_k * one_expert
    assert moe.active_matmul_params(spec, D, F) == active

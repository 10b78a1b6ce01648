"""What the padded expert grouping (`moe.experts_padded`) holds and how it sums kernel gradients:
the planner's count of its working set against the temporaries XLA compiles for a real layer's
rematerialised backward, and bfloat16 kernel gradients against float32 ones."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxzero.models import moe
from jaxzero.planner.memory import padded_experts_bytes


def _backward_temp_bytes(T: int, k: int, E: int, D: int, F: int, B: int, kernel_grads: bool) -> int:
    """Temporaries of one compiled bfloat16 MoE layer's rematerialised gradient (CPU backend)."""
    spec = moe.qwen3_moe_spec(E, k, norm_topk_prob=True)
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), moe.init_moe(jax.random.PRNGKey(0), spec, D, F))
    x = jax.random.normal(jax.random.PRNGKey(1), (T, D), jnp.bfloat16)
    experts_fn = functools.partial(moe.experts_padded, block_rows=B)

    def loss(p, x):
        return jnp.sum(moe.moe_block(p, x, spec, experts_fn=experts_fn)[0].astype(jnp.float32))

    grad = jax.grad(jax.checkpoint(loss), argnums=(0, 1) if kernel_grads else 1)
    return jax.jit(grad).lower(params, x).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("kernel_grads", [True, False], ids=["full", "frozen_experts"])
@pytest.mark.parametrize(
    "T,k,E,D,F,B",
    [
        (256, 2, 16, 128, 64, 256),  # padding dominates: 16 experts' blocks for 512 rows
        (1024, 8, 64, 128, 48, 256),  # many experts, top-8 (Qwen3-MoE's routing)
        (2048, 2, 8, 256, 512, 256),  # few wide experts, top-2 (Mixtral's)
        (512, 4, 8, 64, 32, 32),  # small blocks
    ],
)
def test_planner_counts_what_the_padded_grouping_compiles_to(T, k, E, D, F, B, kernel_grads):
    """The count is the gathered kernels, the padded rows and the sorted rows, once: what XLA's GPU
    compiler held for one layer's gradient on an H100 (-3% to +8% at Qwen3-30B-A3B's and Mixtral's
    layers; `padded_experts_bytes`). The CPU backend keeps those and their gradients apart, about
    twice the count here (1.8x-2.8x). Counting the tokens' rows instead of the padded ones, or
    blocks of another size, falls far outside."""
    count = padded_experts_bytes(T, k, E, D, F, 2, block_rows=B)
    temp = _backward_temp_bytes(T, k, E, D, F, B, kernel_grads)
    assert 1.6 * count <= temp <= 3.0 * count, (count, temp, temp / count)


def bfloat16_errors(spec, params, x, cotangent, block_rows: int, leaf: str) -> dict[str, float]:
    """Relative error (Frobenius) of each expert projection's `leaf` gradient of sum(y * cotangent),
    the padded grouping in bfloat16 against float32 compute on the same inputs."""
    experts_fn = functools.partial(moe.experts_padded, block_rows=block_rows)

    def grads(dtype):
        def loss(p):
            y = moe.moe_block(p, x.astype(dtype), spec, experts_fn=experts_fn)[0]
            return jnp.sum(y.astype(jnp.float32) * cotangent)

        return jax.jit(jax.grad(loss))(params)

    exact, low = grads(jnp.float32), grads(jnp.bfloat16)
    errors = {}
    for name in ("gate_up", "down"):
        a, b = np.asarray(exact[name][leaf]), np.asarray(low[name][leaf], np.float32)
        errors[name] = float(np.linalg.norm(a - b) / np.linalg.norm(a))
    return errors


def test_bfloat16_kernel_gradients_sum_each_experts_blocks_in_float32():
    """Two experts and 8-row blocks: each expert's kernel gradient sums ~128 blocks. Summed in
    bfloat16 (a scatter-add rounding after every block) its error against float32 compute is
    1.2-2.5%; summed in float32 and rounded once it is that of bfloat16 inputs, under 0.5%."""
    T, E, D, F = 2048, 2, 32, 16
    spec = moe.qwen3_moe_spec(E, 1, norm_topk_prob=True)
    params = moe.init_moe(jax.random.PRNGKey(0), spec, D, F)
    # positive inputs: the blocks' gradients add up with one sign, as rounding errors do
    x = jnp.abs(jax.random.normal(jax.random.PRNGKey(1), (T, D), jnp.float32))
    errors = bfloat16_errors(spec, params, x, jnp.ones((T, D)), 8, "kernel")
    assert max(errors.values()) < 0.007, errors


def test_bfloat16_bias_gradients_sum_each_blocks_rows_in_float32():
    """gpt-oss's expert biases in 256-row blocks: a bias's gradient sums its block's rows. Summed in
    bfloat16 (the transpose of a bfloat16 broadcast add) its error against float32 compute on the
    same rounded inputs was 0.7% for both biases; summed in float32 and rounded once, 0.4% and 0.2%."""
    T, E, D, F = 2048, 2, 32, 16
    spec = moe.gpt_oss_spec(E, 1)

    def rounded(a: jax.Array) -> jax.Array:
        return a.astype(jnp.bfloat16).astype(jnp.float32)

    params = jax.tree.map(rounded, moe.init_moe(jax.random.PRNGKey(0), spec, D, F))
    x = rounded(jax.random.normal(jax.random.PRNGKey(1), (T, D), jnp.float32))
    cotangent = rounded(jax.random.normal(jax.random.PRNGKey(2), (T, D), jnp.float32))
    errors = bfloat16_errors(spec, params, x, cotangent, 256, "bias")
    assert max(errors.values()) < 0.005, errors


def test_an_int8_moe_base_is_counted_as_narrow_block_stores_it():
    """The experts' and the router's kernels are int8 with a float32 scale per output channel of
    each expert (`narrow_block`), as the attention's are: the plan counts the stored block's bytes."""
    from jaxzero.config import TrainConfig
    from jaxzero.finetune.base import narrow_block
    from jaxzero.models import build_model
    from jaxzero.overrides import apply_overrides
    from jaxzero.planner.partial import partial_bytes

    over = {"finetune.method": "lora", "finetune.lora_targets": "q,k,v,o", "finetune.base_dtype": "int8",
            "model.num_experts": "8", "model.num_experts_per_tok": "2", "model.moe_intermediate_size": "48",
            "model.num_layers": "2"}  # fmt: skip
    cfg = apply_overrides(TrainConfig(), over)
    model = build_model(cfg.model)
    stored = jax.eval_shape(lambda k: narrow_block(model.init_block(k), "int8"), jax.random.key(0))
    nbytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(stored))
    assert partial_bytes(cfg, streamed=True).base_blocks == cfg.model.num_layers * nbytes

"""The experts' grouped matmul (jaxzero.models.grouped_matmul): its custom gradient's wiring against
JAX's own gradient of jax.lax.ragged_dot, and which grouping `model.moe_impl` runs where. The Mosaic
GPU kernels themselves run only on Hopper GPUs (scripts/bench_moe.py checks them there against the
padded grouping); here three CPU kernels of the same contracts stand in for them."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxzero.config import ConfigError, ModelConfig, TrainConfig
from jaxzero.models import grouped_matmul, moe
from jaxzero.models.sizes import NAMED_SIZES
from jaxzero.planner import memory, preflight
from jaxzero.planner.machine import CPU, H100, H200, OTHER_GPU

SIZES = np.array([3, 0, 5, 1, 7], np.int32)  # an empty group, a group of one
N, I, O = int(SIZES.sum()), 6, 4  # noqa: E741


def _expert_of_row(sizes: jax.Array, n: int) -> jax.Array:
    return jnp.repeat(jnp.arange(sizes.shape[0]), sizes, total_repeat_length=n)


def _kernels_grad(rows, dy, sizes):  # rows_g.T @ dy_g for each group, by a one-hot of each row's group
    onehot = jax.nn.one_hot(_expert_of_row(sizes, rows.shape[0]), sizes.shape[0], dtype=rows.dtype)
    return jnp.einsum("ni,ne,no->eio", rows, onehot, dy)


def _rows_grad(dy, kernels, sizes):
    return jax.lax.ragged_dot(dy, jnp.swapaxes(kernels, 1, 2), sizes)


STAND_IN = grouped_matmul.with_vjp(jax.lax.ragged_dot, _rows_grad, _kernels_grad)


def test_the_custom_gradient_equals_ragged_dots_own():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    rows = jax.random.normal(k1, (N, I), jnp.float32)
    kernels = jax.random.normal(k2, (len(SIZES), I, O), jnp.float32)
    cot = jax.random.normal(k3, (N, O), jnp.float32)
    sizes = jnp.asarray(SIZES)

    def loss(matmul, rows, kernels):
        return jnp.sum(matmul(rows, kernels, sizes) * cot)

    want = jax.grad(functools.partial(loss, jax.lax.ragged_dot), (0, 1))(rows, kernels)
    got = jax.jit(jax.grad(functools.partial(loss, STAND_IN), (0, 1)))(rows, kernels)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6, atol=1e-6)
    assert float(jnp.max(jnp.abs(got[1][1]))) == 0.0  # the empty group's kernel gets nothing


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_experts_through_the_custom_gradient_equal_the_padded_grouping(family):
    """The grouped matmul as the Mosaic kernels get it (rows and widths padded to whole tiles, here
    of 8) equals the padded grouping, product and every gradient; gpt-oss's experts carry biases,
    which reach the kernels as one more row of each expert's kernel (`moe._grouped`)."""
    spec = {
        "qwen3_moe": moe.qwen3_moe_spec(num_experts=5, top_k=2, norm_topk_prob=True),
        "gpt_oss": moe.gpt_oss_spec(num_experts=5, top_k=2),
    }[family]
    params = moe.init_moe(jax.random.key(1), spec, hidden=8, intermediate=6, std=0.3)
    noise = jax.random.key(4)  # nonzero biases too
    params = jax.tree.map(lambda a: a + 0.1 * jax.random.normal(noise, a.shape), params)
    x = jax.random.normal(jax.random.key(2), (13, 8), jnp.float32)
    cot = jax.random.normal(jax.random.key(3), (13, 8), jnp.float32)

    def loss(fn, params, x):
        return jnp.sum(moe.moe_block(params, x, spec, experts_fn=fn)[0] * cot)

    def whole_tiles(kernel):  # like each Mosaic kernel, whole tiles of 8 only
        def run(a, b, sizes):
            assert all(n % 8 == 0 for n in (*a.shape, *b.shape[-2:])), (a.shape, b.shape)
            return kernel(a, b, sizes)

        return run

    kernels = (jax.lax.ragged_dot, _rows_grad, _kernels_grad)
    mosaic_like = grouped_matmul.tiled_matmul(*map(whole_tiles, kernels), rows=8, widths=8)
    grouped = functools.partial(moe.experts_ragged_dot, matmul=mosaic_like)
    want = jax.jit(jax.grad(functools.partial(loss, moe.experts_padded), (0, 1)))(params, x)
    got = jax.jit(jax.grad(functools.partial(loss, grouped), (0, 1)))(params, x)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-6)


def test_auto_runs_the_padded_grouping_off_hopper_and_mosaic_is_refused_there():
    assert grouped_matmul.experts_impl("auto", jnp.bfloat16) == "padded"  # the CPU backend
    assert moe.experts_for("auto", jnp.bfloat16) is moe.experts_padded
    assert grouped_matmul.experts_impl("padded", jnp.bfloat16) == "padded"
    with pytest.raises(ConfigError, match="moe_impl=mosaic cannot be used: they run on CUDA GPUs.*'cpu'"):
        grouped_matmul.experts_impl("mosaic", jnp.bfloat16)
    with pytest.raises(ConfigError, match="'fast' is not one of"):
        grouped_matmul.experts_impl("fast", jnp.bfloat16)


def test_auto_means_mosaic_on_hopper_kinds_for_shapes_and_dtypes_the_kernels_take():
    auto = functools.partial(grouped_matmul.planned_impl, "auto")
    assert auto(H100.kind, 1, "bfloat16") == "mosaic"  # Qwen3-MoE's, Mixtral's, gpt-oss's; any widths
    assert grouped_matmul.planned_impl("mosaic", H200.kind, 1, "bfloat16") == "mosaic"
    assert auto(H200.kind, 1, "float32") == "padded"
    assert auto(H200.kind, 2, "bfloat16") == "padded"  # over a mesh: not partitioned
    assert auto(OTHER_GPU.kind, 1, "bfloat16") == "padded"
    assert auto(CPU.kind, 1, "bfloat16") == "padded"


def test_the_resolution_pass_decides_auto_for_the_machine_and_the_plan_counts_that_grouping():
    model = dataclasses.replace(NAMED_SIZES["qwen3-30b-a3b"], num_layers=2)
    cfg = TrainConfig(model=model)
    on_h100 = preflight.resolve_moe_impl(cfg, H100.kind)
    assert on_h100.model.moe_impl == "mosaic"
    assert preflight.resolve_moe_impl(cfg, CPU.kind).model.moe_impl == "padded"
    assert preflight.resolve_moe_impl(cfg, H100.kind, devices=2).model.moe_impl == "padded"
    padded = dataclasses.replace(cfg, model=dataclasses.replace(model, moe_impl="padded"))
    assert preflight.resolve_moe_impl(padded, H100.kind) is padded  # the user's choice stands
    mosaic = dataclasses.replace(cfg, model=dataclasses.replace(model, moe_impl="mosaic"))
    assert preflight.resolve_moe_impl(mosaic, H200.kind) is mosaic
    with pytest.raises(ConfigError, match="moe_impl=mosaic cannot be used: they are written for Hopper.*CPU"):
        preflight.resolve_moe_impl(mosaic, CPU.kind)  # before anything is built
    with pytest.raises(ConfigError, match="the run spans 2"):
        preflight.resolve_moe_impl(mosaic, H100.kind, devices=2)
    dense = TrainConfig()
    assert preflight.resolve_moe_impl(dense, H100.kind) is dense

    tokens, k, d, f = 8 * 2048, model.num_experts_per_tok, model.hidden_size, model.moe_intermediate_size
    grouped = memory.transient_activations(on_h100.model, tokens).block
    blocks = memory.transient_activations(padded.model, tokens).block
    assert blocks - grouped == memory.padded_experts_bytes(tokens, k, model.num_experts, d, f, 2) - (
        tokens * k * (3 * d + 3 * f) * 2
    )
    # undecided, the plan counts the larger: the padded grouping's
    assert memory.transient_activations(model, tokens).block == blocks
    # gpt-oss's biased experts take the Mosaic kernels too; their widths (2,880) reach the kernels
    # padded to 2,944, and the plan then counts the padded copies
    oss = dataclasses.replace(NAMED_SIZES["gpt-oss-20b"], num_layers=2)
    assert preflight.resolve_moe_impl(TrainConfig(model=oss), H100.kind).model.moe_impl == "mosaic"
    oss_mosaic = TrainConfig(model=dataclasses.replace(oss, moe_impl="mosaic"))
    assert preflight.resolve_moe_impl(oss_mosaic, H100.kind) is oss_mosaic
    rows_only = tokens * 4 * (3 * 2880 + 3 * 2880) * 2
    copies = 2 * 32 * 3 * 2944 * 2944 * 2  # the padded kernels and their gradient
    assert memory.grouped_experts_bytes(tokens, 4, 32, 2880, 2880, 2) == rows_only + copies
    assert memory.grouped_experts_bytes(tokens, k, 128, d, f, 2) == tokens * k * (3 * d + 3 * f) * 2


def test_layers_at_one_shape_share_one_lowering_of_the_kernels():
    """A model's every layer calls the grouped matmul at one shape: its kernels are lowered once per
    module, not once per layer (a Pallas kernel lowered per call site made a 48-layer model's
    compile minutes long), under remat and differentiation as the engines run it."""
    rows, kernels, sizes = jnp.ones((N, I)), jnp.ones((len(SIZES), I, I)), jnp.asarray(SIZES)

    def products(layers: int) -> int:  # the matrix products in the lowered module's text
        def loss(rows, kernels):
            for _ in range(layers):
                rows = jax.checkpoint(lambda r: jnp.tanh(STAND_IN(r, kernels, sizes)))(rows)
            return jnp.sum(rows)

        return jax.jit(jax.grad(loss, (0, 1))).lower(rows, kernels).as_text().count("dot_general")

    assert products(6) == products(2) > 0


def test_the_plan_counts_each_tokens_top_k_experts_at_their_groupings_share_of_the_rate():
    """A MoE step's predicted GPU time counts the experts a token is routed to, not every expert, at
    the grouped matmuls' share of the dense rate for their shape (`cost.experts_share`); so does LoRA's."""
    from jaxzero import parse_args
    from jaxzero.planner import partial
    from jaxzero.planner.cost import experts_share

    shape = ["--model.name=qwen3-30b-a3b", "--model.num_layers=4", "--data.batch_size=2"]
    h100 = ["--machine.gpu_gib=75", "--machine.host_gib=125", "--machine.cores=16"]

    def decided(*more: str):
        return preflight.decide(parse_args([*shape, *h100, "--offload.optimizer=cpu", *more]))

    mosaic = decided()
    assert mosaic.config.model.moe_impl == "mosaic"  # one H100, known by its memory
    padded = decided("--model.moe_impl=padded")
    m, d = mosaic.config.model, mosaic.config.data
    routed = m.num_experts_per_tok * 3 * m.hidden_size * m.moe_intermediate_size
    tokens = d.batch_size * d.seq_len
    share = {i: experts_share(dataclasses.replace(m, moe_impl=i), tokens) for i in ("mosaic", "padded")}
    # fewer rows per expert than the calibration's: its least intensity's share, not extrapolated
    assert (share["mosaic"], share["padded"]) == pytest.approx((0.41, 0.25), abs=5e-3)
    extra = 8 * m.num_layers * routed * (1 / share["padded"] - 1 / share["mosaic"]) * tokens
    assert padded.prediction.gpu_s - mosaic.prediction.gpu_s == pytest.approx(
        extra / mosaic.machine.gpu_flops, rel=1e-6
    )
    # twice the experts, each token still routed to k of them: the same work but for the router's
    more = decided(f"--model.num_experts={2 * m.num_experts}")
    assert more.prediction.gpu_s == pytest.approx(mosaic.prediction.gpu_s, rel=1e-3)
    # a micro-batch of 16 x 2,048 tokens: 4,096 rows per expert, a larger share than the least
    wide = dataclasses.replace(m, num_experts=64)
    assert experts_share(wide, 16 * 2048) > experts_share(wide, 2 * 2048) == share["mosaic"]
    # LoRA over the frozen experts: forward, recomputation and input gradients, at the same share
    ft = dataclasses.replace(mosaic.config.finetune, method="lora")
    lora = dataclasses.replace(mosaic.config, finetune=ft)
    slower = partial.step_flops(lora, expert_share=share["mosaic"]) - partial.step_flops(lora)
    assert slower == pytest.approx(6 * m.num_layers * routed * (1 / share["mosaic"] - 1) * tokens, rel=1e-9)


@pytest.mark.parametrize(
    "name, mosaic, padded", [("qwen3-30b-a3b", 0.41, 0.25), ("mixtral-8x7b", 0.69, 0.28)]
)
def test_the_experts_share_of_the_rate_is_the_measured_one_at_the_calibrated_layers(name, mosaic, padded):
    """The share curve passes through the layers it was fitted to (16,384 tokens on an H100:
    BENCHMARKS.md, "Calibration: the experts' grouped matmuls"): small experts and wide ones."""
    from jaxzero.planner.cost import experts_share

    m = ModelConfig.named(name)
    assert experts_share(dataclasses.replace(m, moe_impl="mosaic"), 16384) == pytest.approx(mosaic, abs=5e-3)
    assert experts_share(dataclasses.replace(m, moe_impl="padded"), 16384) == pytest.approx(padded, abs=5e-3)
    assert experts_share(ModelConfig.named("llama-tiny"), 16384) == 1.0


def test_widths_padded_to_the_kernels_tile_give_the_same_product_and_gradients():
    """The Mosaic kernels tile both widths of the kernels by 128, and gpt-oss's are 2,880:
    `dims_padded` hands them zero columns of the rows and zero rows and columns of the kernels, and
    cuts the product back. Product and both gradients equal the unpadded ones (the same terms plus
    zeros; the CPU stand-in may associate a longer sum differently, so to float32 rounding), for
    widths padded on either side, both, or neither."""
    seen = []

    def tiled(rows, kernels, sizes):  # a grouped matmul that, like the kernels, takes whole tiles only
        seen.append(kernels.shape[1:])
        assert rows.shape[1] == kernels.shape[1] and kernels.shape[1] % 8 == 0 and kernels.shape[2] % 8 == 0
        return STAND_IN(rows, kernels, sizes)

    padded = grouped_matmul.dims_padded(tiled, 8)
    k1, k2, k3 = jax.random.split(jax.random.key(2), 3)
    group_sizes = jnp.asarray(SIZES)
    for i, o in ((6, 4), (16, 12), (13, 16), (16, 8)):
        rows = jax.random.normal(k1, (N, i), jnp.float32)
        kernels = jax.random.normal(k2, (len(SIZES), i, o), jnp.float32)
        cot = jax.random.normal(k3, (N, o), jnp.float32)

        def loss(matmul, rows, kernels, cot=cot):
            return jnp.sum(matmul(rows, kernels, group_sizes) * cot)

        want = jax.value_and_grad(functools.partial(loss, STAND_IN), (0, 1))(rows, kernels)
        got = jax.value_and_grad(functools.partial(loss, padded), (0, 1))(rows, kernels)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
        for g, w in zip(got[1], want[1]):
            assert g.shape == w.shape
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
        assert seen[-1] == (-(-i // 8) * 8, -(-o // 8) * 8)


def test_rows_padded_to_the_kernels_tile_give_the_same_product_and_gradients():
    """The Mosaic kernels refuse a row count that is no multiple of their tile (decoding a prompt
    routes a few rows): `rows_padded` hands the kernels zero rows up to it, in the last group, and
    cuts the product back. Product and both gradients equal the unpadded ones, where the last group
    has rows of its own and where it is empty and takes the padding alone."""
    seen = []

    def tiled(rows, kernels, sizes):  # a grouped matmul that, like the kernels, takes whole tiles only
        seen.append(rows.shape[0])
        assert rows.shape[0] % 8 == 0, rows.shape
        return STAND_IN(rows, kernels, sizes)

    padded = grouped_matmul.rows_padded(tiled, 8)
    k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
    for sizes in (np.array([3, 0, 5, 1, 4], np.int32), np.array([3, 2, 0, 4, 0], np.int32)):
        n = int(sizes.sum())
        rows = jax.random.normal(k1, (n, I), jnp.float32)
        kernels = jax.random.normal(k2, (len(sizes), I, O), jnp.float32)
        cot = jax.random.normal(k3, (n, O), jnp.float32)

        group_sizes = jnp.asarray(sizes)

        def loss(matmul, rows, kernels, group_sizes=group_sizes, cot=cot):
            return jnp.sum(matmul(rows, kernels, group_sizes) * cot)

        want = jax.value_and_grad(functools.partial(loss, jax.lax.ragged_dot), (0, 1))(rows, kernels)
        got = jax.value_and_grad(functools.partial(loss, padded), (0, 1))(rows, kernels)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
        for g, w in zip(got[1], want[1]):
            assert g.shape == w.shape
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
    assert seen and all(s % 8 == 0 for s in seen) and min(seen) > 0
    rows = jnp.ones((16, I), jnp.float32)  # already whole tiles: handed over as they are
    padded(rows, jnp.ones((len(SIZES), I, O), jnp.float32), jnp.asarray(np.array([16, 0, 0, 0, 0], np.int32)))
    assert seen[-1] == 16

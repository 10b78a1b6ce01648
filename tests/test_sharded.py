"""ZeRO stages over 4 fake devices against the single-device resident trainer.

Every valid pairing of `parallel.zero_stage` and offload mode trains the same global batches as the
1-device reference. The sharded runs add reduction orders of their own (a gradient is summed over
4 devices' rows, then reduce-scattered), so the tolerances are test_offload.py's float32 ones, fixed:
per-step losses within 1e-5 absolute, final parameters within 2e-5 relative per leaf.
"""

import jax
import numpy as np
import pytest
from test_offload import GPT_OSS

from jaxzero.config import ConfigError, TrainConfig
from jaxzero.data import build_data
from jaxzero.overrides import apply_overrides
from jaxzero.plan import placement
from jaxzero.trainer import build_trainer

STEPS = 4
PARAM_TOL, LOSS_TOL = 2e-5, 1e-5
OFFLOAD = {
    "none": {},
    "optimizer": {"offload.optimizer": "cpu"},
    "params": {"offload.optimizer": "cpu", "offload.params": "cpu"},
}
VALID = [("none", s) for s in range(4)] + [("optimizer", s) for s in (1, 2, 3)] + [("params", 3)]
INVALID = [("optimizer", 0)] + [("params", s) for s in (0, 1, 2)]


def tiny(family: str, **over) -> TrainConfig:
    return apply_overrides(
        TrainConfig(),
        {
            "model.name": f"{family}-tiny",
            "model.num_layers": "2",
            "model.compute_dtype": "float32",
            "data.seq_len": "32",
            "data.batch_size": "16",
            "data.grad_accum": "2",
            "steps": str(STEPS),
            "optimizer.grad_clip": "0.5",
            "optimizer.warmup_steps": "2",
            "optimizer.lr": "1e-2",
            **over,
        },
    )


def run(cfg: TrainConfig, devices: int):
    mesh = placement.make_mesh(jax.devices()[:devices])
    trainer = build_trainer(cfg, mesh)
    data = build_data(cfg.data, cfg.model.vocab_size, cfg.seed)
    batches = data.train_iter()
    state = trainer.init(jax.random.key(cfg.seed))
    losses, norms = [], []
    for _ in range(cfg.steps):
        state, m = trainer.step(state, trainer.put_batch(next(batches)))
        losses.append(float(m.loss))
        norms.append(float(m.grad_norm))
    val = float(trainer.eval_loss(state, trainer.put_eval_batch(data.val_batches(1)[0])))
    return trainer, state, np.array(losses), np.array(norms), val


@pytest.fixture(scope="module")
def reference():
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = run(tiny(family), devices=1)
        return cache[family]

    return get


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("offload, stage", VALID)
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_zero_stage_on_four_devices_matches_one_device(reference, family, offload, stage):
    _, ref_state, ref_losses, ref_norms, ref_val = reference(family)
    cfg = tiny(family, **OFFLOAD[offload], **{"parallel.zero_stage": str(stage)})
    trainer, state, losses, norms, val = run(cfg, devices=4)
    assert trainer.mesh.size == 4 and trainer.plan.zero_stage == stage
    assert ref_norms[0] > 0.5, "clipping must be active in the compared steps"
    assert_matches((state, losses, norms, val), (ref_state, ref_losses, ref_norms, ref_val))


def assert_matches(got, reference) -> None:
    """A sharded run's (state, losses, grad norms, val loss) against the 1-device reference's, within
    the module's fixed tolerances."""
    (state, losses, norms, val), (ref_state, ref_losses, ref_norms, ref_val) = got, reference
    np.testing.assert_allclose(losses, ref_losses, atol=LOSS_TOL, rtol=0)
    np.testing.assert_allclose(norms, ref_norms, rtol=PARAM_TOL)
    assert abs(val - ref_val) < LOSS_TOL
    params, ref_params = jax.device_get(state.params), jax.device_get(ref_state.params)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(ref_params)):
        name = jax.tree_util.keystr(path)
        if name.endswith("['c_attn']['bias']"):  # drop the key third: see test_offload.py's docstring
            d = a.shape[0] // 3
            a, b = np.concatenate([a[:d], a[2 * d :]]), np.concatenate([b[:d], b[2 * d :]])
        assert rel(a, b) < PARAM_TOL, name


def test_each_device_holds_only_its_shard_at_stage_3():
    """ZeRO-3 without offload (FSDP): parameters and optimizer state split over the 4 devices by rows."""
    cfg = tiny("llama", **{"parallel.zero_stage": "3"})
    trainer = build_trainer(cfg, placement.make_mesh(jax.devices()[:4]))
    state = trainer.init(jax.random.key(0))
    leaf = jax.tree.leaves(state.params.embed)[0]
    assert {s.data.shape[0] for s in leaf.addressable_shards} == {leaf.shape[0] // 4}
    mu = [x for x in jax.tree.leaves(state.opt_state) if x.ndim == 2][0]
    assert {s.data.shape[0] for s in mu.addressable_shards} == {mu.shape[0] // 4}


def test_offloaded_host_state_is_one_block_per_process_and_weights_one_shard_per_device():
    cfg = tiny("llama", **OFFLOAD["params"])
    trainer = build_trainer(cfg, placement.make_mesh(jax.devices()[:4]))
    state = trainer.init(jax.random.key(0))
    block = state.weights.blocks[0]
    w = jax.tree.leaves(block)[0]
    assert w.sharding.memory_kind == "pinned_host"
    assert {s.data.shape[0] for s in w.addressable_shards} == {w.shape[0] // 4}
    # One process: its block is every row, kept once (not once per device) on the CPU backend.
    master = jax.tree.leaves(state.params.blocks[0])[0]
    assert master.shape == w.shape and master.sharding.device_set == {jax.devices("cpu")[0]}


@pytest.mark.parametrize("offload, stage", INVALID)
def test_stages_an_offload_mode_cannot_use_are_refused(offload, stage):
    cfg = tiny("llama", **OFFLOAD[offload], **{"parallel.zero_stage": str(stage)})
    with pytest.raises(ConfigError, match="parallel.zero_stage"):
        build_trainer(cfg, placement.make_mesh(jax.devices()[:4]))


def test_auto_stage_is_the_least_replication_each_mode_allows():
    stages = {
        name: build_trainer(tiny("llama", **over), placement.make_mesh(jax.devices()[:1])).plan.zero_stage
        for name, over in OFFLOAD.items()
    }
    assert stages == {"none": 0, "optimizer": 2, "params": 3}


# The offload engine's other strategies, sharded over 4 devices against themselves on one device.
STRATEGIES = {
    "delayed": ({"offload.update": "delayed"}, "float32"),
    "optax": ({"offload.fused_update": "false"}, "float32"),
    "float16": ({"model.compute_dtype": "float16"}, "float16"),
    # One micro-batch: block gradients leave in bfloat16, reduce-scattered in bfloat16.
    "bf16-one-micro-batch": ({"model.compute_dtype": "bfloat16", "data.grad_accum": "1"}, "bfloat16"),
    # The embedding and block 0 with their state on the accelerators, one shard per device.
    "device-state-units": ({"offload.device_state_units": "2"}, "float32"),
    "device-state-units-float16": (
        {"offload.device_state_units": "2", "model.compute_dtype": "float16"},
        "float16",
    ),
}
# (parameter relative, loss absolute): float32 as above; 16-bit compute as test_offload.py's bfloat16.
STRATEGY_TOL = {"float32": (PARAM_TOL, LOSS_TOL), "float16": (2e-2, 2e-3), "bfloat16": (2e-2, 2e-3)}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_offload_strategies_sharded_over_four_devices_match_one_device(strategy):
    over, kind = STRATEGIES[strategy]
    cfg = tiny("llama", **OFFLOAD["params"], **over)
    _, ref_state, ref_losses, ref_norms, _ = run(cfg, devices=1)
    _, state, losses, norms, _ = run(cfg, devices=4)
    param_tol, loss_tol = STRATEGY_TOL[kind]
    np.testing.assert_allclose(losses, ref_losses, atol=loss_tol, rtol=0)
    np.testing.assert_allclose(norms, ref_norms, rtol=param_tol)
    for a, b in zip(
        jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(jax.device_get(ref_state.params))
    ):
        assert rel(a, b) < param_tol


def test_the_log_line_names_the_stage_and_the_mesh():
    trainer = build_trainer(tiny("llama", **OFFLOAD["optimizer"]), placement.make_mesh(jax.devices()[:4]))
    assert trainer.strategy.endswith("; ZeRO stage 2 over 4 devices in 1 process(es)")
    one = build_trainer(tiny("llama"), placement.make_mesh(jax.devices()[:1]))
    assert "ZeRO" not in one.strategy


def _four_devices_train_as_one(
    variant: dict[str, str], placements=(("params", 3),), unchecked: str | None = None
) -> None:
    """`variant` of the tiny Llama trained on four devices with each (offload, ZeRO stage) of
    `placements` equals one device: its losses, and every parameter but those whose path ends with
    `unchecked`."""
    _, ref_state, ref_losses, _, _ = run(tiny("llama", **variant), devices=1)
    ref_params = jax.device_get(ref_state.params)
    for offload, stage in placements:
        cfg = tiny("llama", **variant, **OFFLOAD[offload], **{"parallel.zero_stage": str(stage)})
        trainer, state, losses, _, _ = run(cfg, devices=4)
        assert trainer.mesh.size == 4
        np.testing.assert_allclose(losses, ref_losses, atol=LOSS_TOL, rtol=0)
        params = jax.tree_util.tree_flatten_with_path(jax.device_get(state.params))[0]
        for (path, a), b in zip(params, jax.tree.leaves(ref_params)):
            name = jax.tree_util.keystr(path)
            if unchecked is None or not name.endswith(unchecked):
                assert rel(a, b) < PARAM_TOL, (offload, name)


def test_biased_llama3_rope_variant_sharded_over_four_devices_matches_one_device():
    """Qwen2's q, k, v biases shard along their only axis like any other leaf; Llama 3.1's rope is the
    same on every device."""
    variant = {
        "model.attention_bias": "true",
        "model.hf_model_type": "qwen2",
        "model.rope_type": "llama3",
        "model.rope_factor": "8",
        "model.rope_original_max_len": "16",
    }
    _four_devices_train_as_one(variant, unchecked="['k_proj']['bias']")  # see test_offload.py's docstring


def test_gemma3_sharded_over_four_devices_matches_one_device():
    """Gemma 3's per-layer inputs (window, rope frequencies) reach the one block program on a mesh as
    on one device: ZeRO-3 offload over four devices trains as one device does."""
    gemma3 = {
        "model.family": "gemma3",
        "model.tie_embeddings": "true",
        "model.head_size": "32",
        "model.sliding_window": "8",
        "model.sliding_window_pattern": "2",
        "model.rope_local_theta": "1e4",
        "model.hf_model_type": "gemma3_text",
    }
    _four_devices_train_as_one(gemma3)


@pytest.mark.parametrize("granite", [False, True], ids=["mixtral", "granitemoe"])
def test_moe_sharded_over_four_devices_matches_one_device(granite):
    """A mixture of experts' (E, D, 2F) and (E, F, D) expert kernels and (D, E) routers shard like any
    leaf under ZeRO-1 and ZeRO-3 offload (two micro-batches a step), and the load-balancing loss's
    statistics sum each micro-batch's tokens over the devices that hold its rows: with a coefficient,
    four devices train as one does. (Its coefficient 0 is the cross-entropy alone, bit for bit:
    tests/test_offload.py.) Granite MoE's four scalars change none of that."""
    moe = {
        "model.num_experts": "4",
        "model.num_experts_per_tok": "2",
        "model.moe_intermediate_size": "64",
        "model.router_aux_loss_coef": "0.05",
    }
    if granite:
        from test_offload import GRANITE_MOE

        moe = {**GRANITE_MOE, **moe}
    _four_devices_train_as_one(moe, placements=(("optimizer", 1), ("params", 3)))


def test_moe_padding_sharded_over_four_devices_matches_one_device():
    """Rows of fine-tuning examples padded after their end-of-text: the padding of each device's rows
    counts in none of the load-balancing loss's statistics, which sum over the devices, so under
    ZeRO-2 resident, ZeRO-1 and ZeRO-3 offload four devices train as one does."""
    from test_offload import example_rows  # rows as the data pads them

    padded = {
        "model.num_experts": "4",
        "model.num_experts_per_tok": "2",
        "model.moe_intermediate_size": "64",
        "model.router_aux_loss_coef": "0.05",
        "data.eot_id": "7",
    }
    rows = example_rows(tiny("llama", **padded), [10, 33, 20, 5, 40, 28, 17])

    def train(cfg: TrainConfig, devices: int):
        trainer = build_trainer(cfg, placement.make_mesh(jax.devices()[:devices]))
        state = trainer.init(jax.random.key(cfg.seed))
        metrics = []
        for batch in rows:
            state, m = trainer.step(state, trainer.put_batch(batch))
            metrics.append((float(m.loss), float(m.aux_loss)))
        return state, np.array(metrics)

    ref_state, ref = train(tiny("llama", **padded), 1)
    for offload, stage in (("none", 2), ("optimizer", 1), ("params", 3)):
        cfg = tiny("llama", **padded, **OFFLOAD[offload], **{"parallel.zero_stage": str(stage)})
        state, got = train(cfg, 4)
        np.testing.assert_allclose(got, ref, atol=LOSS_TOL, rtol=0)
        for a, b in zip(jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(ref_state.params)):
            assert rel(a, b) < PARAM_TOL, offload


def test_phi3_and_olmo2_sharded_over_four_devices_match_one_device():
    """Phi-3's fused (D, (N+2K)H) and (D, 2F) kernels and OLMo 2's (N*H,) and (K*H,) q/k norms shard
    by rows like any leaf: ZeRO-3 offload over four devices trains as one device does."""
    phi3 = {"model.fused_projections": "true", "model.partial_rotary_factor": "0.5"}
    olmo2 = {"model.qk_norm": "true", "model.qk_norm_scope": "projection", "model.post_norm": "true"}
    _four_devices_train_as_one({**phi3, "model.hf_model_type": "phi3"})
    _four_devices_train_as_one({**olmo2, "model.hf_model_type": "olmo2"})


def test_zero3_offload_on_eight_devices_matches_one_device(tmp_path):
    """The 8-GPU node's layout on 8 fake CPU devices (a process of its own: the suite's have 4)."""
    from subprocess_run import run_program

    done = run_program(
        "sharded_eight.py", cwd=tmp_path, env_extra={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "llama 8 devices == 1 device" in done.stdout and "gpt2 8 devices == 1 device" in done.stdout


def test_gpt_oss_sharded_over_four_devices_matches_one_device():
    """gpt-oss's sinks, biases, biased experts and per-layer windows under ZeRO-3 offload over four
    devices: trains as one device does (its k_proj bias exempt, as the Qwen2 variant's)."""
    gpt_oss = {**GPT_OSS, "model.head_size": "32"}
    _four_devices_train_as_one(gpt_oss, unchecked="['k_proj']['bias']")

"""LoRA over a frozen base (`finetune.method=lora`): the trainer's gradients against whole-model
autodiff, a streamed base against a resident one, int8 weights, checkpoints that hold only what trains,
resumed == uninterrupted, the plan, and the refusals."""

import dataclasses
import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_offload import GPT_OSS

from jaxzero.cli import train as train_lib
from jaxzero.config import ConfigError, TrainConfig, padding_id
from jaxzero.config.checks import validate
from jaxzero.data import build_data
from jaxzero.finetune.adapters import adapter_shapes, lora_spec
from jaxzero.finetune.base import narrow_block
from jaxzero.finetune.merged import merge_block, widen
from jaxzero.finetune.part import TrainableOverBase
from jaxzero.models import ModelParams, build_model
from jaxzero.models.lora import merge_trees, quantize_kernel
from jaxzero.numerics.objective import loss_fn, objective_with_aux, real_tokens, step_weight
from jaxzero.overrides import apply_overrides
from jaxzero.plan import placement, resolve_plan
from jaxzero.planner.partial import partial_memory as lora_memory
from jaxzero.resident import build_resident_trainer
from jaxzero.storage.checkpoint_masters import load_masters, read_saved_state
from jaxzero.storage.state_io import restore_state

LORA = {
    "finetune.method": "lora",
    "finetune.lora_rank": "4",
    "finetune.lora_alpha": "8",
    "model.num_layers": "2",
    "data.seq_len": "32",
    "data.batch_size": "4",
    "data.grad_accum": "2",
    "steps": "6",
    "optimizer.warmup_steps": "0",
    "optimizer.lr": "1e-2",
    "logging.log_every": "1",
    "logging.progress": "false",
    "logging.samples": "0",
}
EXACT = {"model.compute_dtype": "float32", "finetune.base_dtype": "float32"}


def lora_cfg(**over: str) -> TrainConfig:
    return apply_overrides(TrainConfig(), {**LORA, **over})


def built(cfg: TrainConfig, streamed: bool = False):
    """The trainer of `cfg`'s run with a frozen part, and what trains in it (which holds the base)."""
    cfg = dataclasses.replace(
        cfg, offload=dataclasses.replace(cfg.offload, params="cpu" if streamed else "none", optimizer="none")
    )
    plan = resolve_plan(dataclasses.replace(cfg, offload=dataclasses.replace(cfg.offload, params="none")))
    mesh = placement.make_mesh(jax.devices()[:1])
    trains = TrainableOverBase(cfg, mesh)
    return build_resident_trainer(cfg, mesh, plan, trains=trains), trains


def trainer_of(cfg: TrainConfig, streamed: bool = False):
    return built(cfg, streamed)[0]


def batches(cfg: TrainConfig, n: int) -> list[np.ndarray]:
    it = build_data(cfg.data, cfg.model.vocab_size, cfg.seed).train_iter()
    return [next(it) for _ in range(n)]


# A mixture-of-experts base whose objective adds the load-balancing loss: its gradient reaches the
# attention's adapters through the frozen routers' inputs.
MOE_AUX = {"model.num_experts": "4", "model.num_experts_per_tok": "2", "model.moe_intermediate_size": "48",
           "finetune.lora_targets": "q,k,v,o", "model.router_aux_loss_coef": "0.5"}  # fmt: skip


@pytest.mark.parametrize("variant", ["dense", "moe+aux", "moe+aux+padding"])
def test_the_adapters_gradient_is_whole_model_autodiffs(variant):
    """One step of plain SGD at lr 1 from lora_b = 0 writes -grad into lora_b: it must equal jax.grad
    of the objective over the merged base and adapters (two micro-batches, documents kept apart; for
    "moe+aux" each micro-batch's objective adds coef x its load-balancing loss, averaged; for
    "+padding" rows end with padding after an end-of-text, which that loss's statistics leave out)."""
    sgd = {"optimizer.name": "sgd", "optimizer.momentum": "0", "optimizer.weight_decay": "0",
           "optimizer.grad_clip": "0", "optimizer.lr": "1", "optimizer.schedule": "constant",
           "data.eot_id": "10"}  # fmt: skip
    cfg = lora_cfg(**EXACT, **sgd, **(MOE_AUX if variant.startswith("moe") else {}))
    trainer, trains = built(cfg)
    state = trainer.init(jax.random.key(3))
    adapters0 = jax.tree.map(np.asarray, state.params)
    base = jax.tree.map(np.asarray, trains.base().units)
    batch = batches(cfg, 1)[0]
    if variant.endswith("+padding"):  # as the data pads rows of examples (`jaxzero.data.packing`)
        batch = batch.copy()
        batch[:, :2, 20], batch[:, :2, 21:] = 10, ~padding_id(10)
    state, metrics = trainer.step(state, trainer.put_batch(batch))
    stepped = -np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(
        jax.tree.map(lambda b: b, [blk for blk in state.params.blocks]))])  # fmt: skip

    model = dataclasses.replace(build_model(cfg.model), lora=lora_spec(cfg.finetune))
    weight = step_weight(jnp.asarray(batch)) / batch.shape[0]

    coef, micro = cfg.model.router_aux_loss_coef, batch.shape[0]

    def objective(params, w):
        if variant == "dense":
            return loss_fn(model, params, w, weight, eot_id=10), 0.0
        mask = real_tokens(w, 10) if variant.endswith("+padding") else None
        ce, aux = objective_with_aux(model, params, w, weight, eot_id=10, token_mask=mask)[1]
        return ce + coef * aux / micro, aux / micro

    def loss(adapters):
        blocks = tuple(merge_trees(b, a) for b, a in zip(base.blocks, adapters.blocks))
        params = ModelParams(base.embed, blocks, base.head)
        terms = [objective(params, jnp.asarray(w)) for w in batch]
        return sum(t[0] for t in terms), sum(t[1] for t in terms)

    grads, aux = jax.grad(loss, has_aux=True)(adapters0)
    if variant != "dense":
        assert float(metrics.aux_loss) == pytest.approx(float(aux), rel=1e-5)
    want = np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(list(grads.blocks))])
    # lora_a's gradient is 0 while lora_b is 0, so its step leaves it where it was.
    a_moved = [
        np.asarray(b["lora_a"])
        for b in jax.tree.leaves(state.params.blocks, is_leaf=lambda x: isinstance(x, dict) and "lora_a" in x)
    ]
    a_before = [
        np.asarray(b["lora_a"])
        for b in jax.tree.leaves(adapters0.blocks, is_leaf=lambda x: isinstance(x, dict) and "lora_a" in x)
    ]
    assert all(np.array_equal(x, y) for x, y in zip(a_moved, a_before))
    b_stepped = np.concatenate(
        [
            -np.ravel(np.asarray(b["lora_b"]))
            for b in jax.tree.leaves(
                state.params.blocks, is_leaf=lambda x: isinstance(x, dict) and "lora_a" in x
            )
        ]
    )
    b_want = np.concatenate(
        [
            np.ravel(np.asarray(b["lora_b"]))
            for b in jax.tree.leaves(grads.blocks, is_leaf=lambda x: isinstance(x, dict) and "lora_a" in x)
        ]
    )
    assert np.max(np.abs(b_want)) > 0
    np.testing.assert_allclose(b_stepped, b_want, rtol=0, atol=1e-5 * np.max(np.abs(b_want)))
    assert stepped.shape == want.shape
    assert np.isclose(float(metrics.grad_norm), float(np.linalg.norm(want)), rtol=1e-5)


def resident_then_streamed(cfg: TrainConfig, steps: int) -> list[tuple[list[float], list[np.ndarray]]]:
    """`steps` steps of `cfg`'s run with a frozen part from one init, its base resident then streamed:
    for each, the losses and the trainable leaves after the last step."""
    data = batches(cfg, steps)
    out = []
    for streamed in (False, True):
        trainer = trainer_of(cfg, streamed)
        state = trainer.init(jax.random.key(0))
        losses = []
        for b in data:
            state, m = trainer.step(state, trainer.put_batch(b))
            losses.append(float(m.loss))
        out.append((losses, [np.asarray(x) for x in jax.tree.leaves(state.params)]))
    return out


def test_a_streamed_base_trains_bitwise_as_a_resident_one():
    out = resident_then_streamed(lora_cfg(**EXACT, **{"finetune.lora_dropout": "0.1"}), 3)
    assert out[0][0] == out[1][0]
    assert all(np.array_equal(a, b) for a, b in zip(out[0][1], out[1][1]))
    assert out[0][0][-1] < out[0][0][0]


def test_a_streamed_gemma3_base_trains_bitwise_as_a_resident_one():
    """Gemma 3's layers differ by their per-layer input (window, rope base), which the frozen-part
    trainer's streamed schedule passes as the resident one does; an int8 base as well."""
    gemma3 = {
        "model.family": "gemma3",
        "model.tie_embeddings": "true",
        "model.head_size": "32",
        "model.sliding_window": "8",
        "model.sliding_window_pattern": "2",
        "model.rope_local_theta": "1e4",
        "model.hf_model_type": "gemma3_text",
    }
    out = resident_then_streamed(lora_cfg(**EXACT, **gemma3), 3)
    assert out[0][0] == out[1][0]
    assert all(np.array_equal(a, b) for a, b in zip(out[0][1], out[1][1]))
    assert out[0][0][-1] < out[0][0][0]
    int8 = resident_then_streamed(lora_cfg(**gemma3, **{"finetune.base_dtype": "int8"}), 2)
    assert int8[0][0] == int8[1][0] and np.all(np.isfinite(int8[0][0]))


def test_a_streamed_gpt_oss_base_trains_bitwise_as_a_resident_one():
    """gpt-oss's adapters on its biased attention (PEFT's q_proj ... o_proj) over a frozen base of
    sinks and biased experts, whose windows are per-layer inputs: streamed as resident; int8 as well."""
    gpt_oss = {
        **GPT_OSS,
        "model.head_size": "32",
        "model.moe_intermediate_size": "48",
        "finetune.lora_targets": "q,k,v,o",
    }
    out = resident_then_streamed(lora_cfg(**EXACT, **gpt_oss), 3)
    assert out[0][0] == out[1][0]
    assert all(np.array_equal(a, b) for a, b in zip(out[0][1], out[1][1]))
    assert out[0][0][-1] < out[0][0][0]
    int8 = resident_then_streamed(lora_cfg(**gpt_oss, **{"finetune.base_dtype": "int8"}), 2)
    assert int8[0][0] == int8[1][0] and np.all(np.isfinite(int8[0][0]))


MOE = {"model.num_experts": "4", "model.num_experts_per_tok": "2", "model.moe_intermediate_size": "48",
       "finetune.lora_targets": "q,k,v,o"}  # fmt: skip


def test_a_streamed_moe_base_trains_bitwise_as_a_resident_one():
    """Adapters on the attention of a mixture-of-experts base (router and experts frozen, PEFT's
    q_proj ... o_proj), streamed or resident; an int8 base quantises each expert's kernels per
    output channel, as one (in, out) kernel each."""
    out = resident_then_streamed(lora_cfg(**EXACT, **MOE), 3)
    assert out[0][0] == out[1][0]
    assert all(np.array_equal(a, b) for a, b in zip(out[0][1], out[1][1]))
    assert out[0][0][-1] < out[0][0][0]
    int8 = resident_then_streamed(lora_cfg(**MOE, **{"finetune.base_dtype": "int8"}), 2)
    assert int8[0][0] == int8[1][0] and np.all(np.isfinite(int8[0][0]))

    stacked = jax.random.normal(jax.random.key(0), (3, 8, 5))
    q, scale = quantize_kernel(stacked)
    assert q.shape == (3, 8, 5) and scale.shape == (3, 5)
    for e in range(3):
        qe, se = quantize_kernel(stacked[e])
        assert np.array_equal(q[e], qe) and np.array_equal(scale[e], se)


PHI3 = {"model.fused_projections": "true", "model.partial_rotary_factor": "0.5",
        "model.hf_model_type": "phi3", "finetune.lora_targets": "qkv,o,gate_up,down"}  # fmt: skip
OLMO2 = {"model.qk_norm": "true", "model.qk_norm_scope": "projection", "model.post_norm": "true",
         "model.hf_model_type": "olmo2"}  # fmt: skip


@pytest.mark.parametrize("variant", [PHI3, OLMO2], ids=["phi3", "olmo2"])
def test_streamed_phi3_and_olmo2_bases_train_bitwise_as_resident_ones(variant):
    """Adapters on Phi-3's fused qkv_proj and gate_up_proj (PEFT's targets) and on every OLMo 2
    projection train the same over a streamed base as over a resident one; an int8 base as well
    (a fused kernel quantised per output channel, as any other)."""
    out = resident_then_streamed(lora_cfg(**EXACT, **variant), 3)
    assert out[0][0] == out[1][0]
    assert all(np.array_equal(a, b) for a, b in zip(out[0][1], out[1][1]))
    assert out[0][0][-1] < out[0][0][0]
    int8 = resident_then_streamed(lora_cfg(**variant, **{"finetune.base_dtype": "int8"}), 2)
    assert int8[0][0] == int8[1][0] and np.all(np.isfinite(int8[0][0]))


def test_int8_kernels_stay_within_half_a_step_of_their_channel_and_dequantise_inside_the_block():
    rng = np.random.default_rng(0)
    k = rng.standard_normal((48, 40)).astype(np.float32) * rng.uniform(0.01, 3, (1, 40)).astype(np.float32)
    k[:, 7] = 0.0  # an all-zero channel
    q, scale = map(np.asarray, quantize_kernel(jnp.asarray(k)))
    assert q.dtype == np.int8 and scale.shape == (40,) and scale[7] == 1.0
    assert np.array_equal(np.max(np.abs(q[:, scale != 1.0]), axis=0), np.full(39, 127))  # each channel's peak
    err = np.abs(q.astype(np.float32) * scale[None, :] - k)
    assert np.all(err <= scale[None, :] / 2 * (1 + 1e-5))

    cfg = lora_cfg(**{"model.compute_dtype": "float32", "finetune.base_dtype": "int8"})
    model = build_model(cfg.model)
    block = model.init_block(jax.random.key(1))
    stored = narrow_block(block, "int8")
    assert stored["mlp"]["up_proj"]["kernel"].dtype == jnp.int8 and "kernel_scale" in stored["mlp"]["up_proj"]
    x = jax.random.normal(jax.random.key(2), (2, 16, cfg.model.hidden_size), jnp.float32)
    np.testing.assert_allclose(np.asarray(model.block(stored, x)), np.asarray(model.block(widen(stored), x)),
                               rtol=0, atol=1e-5)  # fmt: skip


def test_an_int8_base_trains_and_its_plan_counts_a_byte_per_weight():
    cfg = lora_cfg(**{"finetune.base_dtype": "int8"})
    trainer = trainer_of(cfg, streamed=True)
    state = trainer.init(jax.random.key(0))
    losses = []
    for b in batches(cfg, 4):
        state, m = trainer.step(state, trainer.put_batch(b))
        losses.append(float(m.loss))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    int8, bf16 = (
        lora_memory(cfg, True),
        lora_memory(
            dataclasses.replace(cfg, finetune=dataclasses.replace(cfg.finetune, base_dtype="bfloat16")), True
        ),
    )
    assert 0.5 < int8.pinned / bf16.pinned < 0.55  # the kernels' byte, their scales and the bf16 norms
    resident = lora_memory(cfg, False)
    assert resident.pinned == 0 and resident.host == 0  # nothing of the base crosses to the host


def test_a_checkpoint_holds_only_the_adapters_and_a_resume_is_exact(tmp_path):
    over = {"optimizer.decay_steps": "6", "finetune.lora_dropout": "0.1"}  # one schedule for both
    whole = train_lib.train(lora_cfg(**over, run_dir=str(tmp_path / "whole")), io.StringIO())
    half = lora_cfg(**over, run_dir=str(tmp_path / "half"), steps="3")
    train_lib.train(half, io.StringIO())
    resumed = train_lib.configure([f"--run_dir={tmp_path / 'half'}", "--steps=6"]).config
    out = io.StringIO()
    train_lib.train(resumed, out)
    assert "resumed from" in out.getvalue()
    a = read_saved_state(whole / "checkpoints" / "6")
    b = read_saved_state(tmp_path / "half" / "checkpoints" / "6")
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    cfg = resumed
    shapes = adapter_shapes(build_model(cfg.model), cfg.finetune)
    assert jax.tree.structure(a["params"]) == jax.tree.structure(shapes)  # no base weights saved
    saved = sum(np.asarray(x).nbytes for x in jax.tree.leaves(a))
    adapters = sum(s.size * 4 for s in jax.tree.leaves(shapes))
    assert saved < 4 * adapters  # adapters, two moments, the step

    # The merged model a checkpoint reads as (samples, eval, export) is the trained one.
    cfg_saved, params, step = load_masters(whole)
    assert step == 6 and cfg_saved.finetune.method == "lora"
    trainer = trainer_of(cfg_saved)
    state, _, _ = restore_state(trainer, whole)
    window = batches(cfg_saved, 1)[0][0]
    lora_loss = float(trainer.eval_loss(state, trainer.put_eval_batch(window)))
    full = build_model(cfg_saved.model)
    merged_loss = float(loss_fn(full, jax.tree.map(jnp.asarray, params), jnp.asarray(window)))
    assert (
        abs(lora_loss - merged_loss) < 2e-2
    )  # bf16 compute: the adapter path rounds apart from a merged kernel


def test_merge_block_adds_the_scaled_product():
    a = np.arange(6, dtype=np.float32).reshape(3, 2)
    b = np.ones((2, 4), np.float32)
    block = {"mlp": {"up_proj": {"kernel": np.zeros((3, 4), np.float32)}}}
    merged = merge_block(block, {"mlp": {"up_proj": {"lora_a": a, "lora_b": b}}}, 0.5)
    np.testing.assert_array_equal(np.asarray(merged["mlp"]["up_proj"]["kernel"]), 0.5 * a @ b)


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"model.name": "gpt2-tiny"}, "llama family"),
        ({"finetune.lora_targets": "q,x"}, "finetune.lora_targets='q,x': x"),
        ({"finetune.lora_rank": "0"}, "finetune.lora_rank=0"),
        ({"finetune.lora_dropout": "1"}, r"finetune.lora_dropout=1.0 must be in \[0, 1\)"),
        ({"offload.optimizer": "cpu"}, "no state to place"),
        ({**MOE, "finetune.lora_targets": "q,up"}, "model.num_experts=4 experts has not"),
    ],
)
def test_wrong_lora_settings_are_refused_before_any_work(over, message):
    with pytest.raises(ConfigError, match=message):
        validate(lora_cfg(**over))


def test_lora_trains_on_one_device_only():
    cfg = lora_cfg()
    if len(jax.devices()) < 2:
        pytest.skip("needs two devices")
    with pytest.raises(ConfigError, match="trains on one device"):
        TrainableOverBase(cfg, placement.make_mesh(jax.devices()[:2]))


def test_a_frozen_part_trains_jaxzeros_model_with_the_configured_optimizer():
    import optax

    cfg = lora_cfg()
    offload = dataclasses.replace(cfg.offload, params="none", optimizer="none")
    plan = resolve_plan(dataclasses.replace(cfg, offload=offload))
    mesh = placement.make_mesh(jax.devices()[:1])
    with pytest.raises(ConfigError, match="model= and optimizer= apply to runs that train every unit"):
        build_resident_trainer(
            cfg, mesh, plan, optimizer=optax.sgd(1e-2), trains=TrainableOverBase(cfg, mesh)
        )


def test_eval_and_export_of_an_int8_lora_run_keep_the_trained_adapters(tmp_path, capsys):
    """`python -m jaxzero.eval` restores the adapters over the base rebuilt as trained (a merge
    quantised again would round small adapter updates away); `python -m jaxzero.export` writes the
    adapter, refuses merged-model flags without --merge, and merges with it; `export_state` alike."""
    from jaxzero.cli import eval as eval_lib
    from jaxzero.cli import export as export_lib
    from jaxzero.data import write_tokens
    from jaxzero.interop.state_export import export_state

    data = tmp_path / "tokens"
    data.mkdir()
    rng = np.random.default_rng(0)
    write_tokens(data / "train.bin", rng.integers(0, 256, 4000), "uint16")
    write_tokens(data / "val.bin", rng.integers(0, 256, 400), "uint16")
    over = {"finetune.base_dtype": "int8", "optimizer.lr": "1e-3", "data.source": "tokens",
            "data.path": str(data), "data.eot_id": "-1", "run_dir": str(tmp_path / "run")}  # fmt: skip
    run = train_lib.train(lora_cfg(**over), io.StringIO())
    assert eval_lib.main([f"--run_dir={run}", f"--data.path={data}"]) == 0
    evaluated = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["loss"]

    cfg = train_lib.configure([f"--run_dir={run}"]).config
    trainer = trainer_of(cfg)
    state, _, _ = restore_state(trainer, run)
    tokens = np.fromfile(data / "val.bin", np.uint16).astype(np.int32)
    windows = np.stack([tokens[s : s + 33] for s in range(0, 400 - 33, 32)])
    direct = float(trainer.eval_loss(state, trainer.put_eval_batch(windows[:12])))
    fresh = trainer.init(jax.random.key(0))  # the base alone: adapters at their init (lora_b = 0)
    base_only = float(trainer.eval_loss(fresh, trainer.put_eval_batch(windows[:12])))
    assert abs(direct - base_only) > 1e-3  # the adapters moved the loss
    # eval's windows are its own batching of val.bin; both read the trained adapters, not the base
    assert abs(evaluated - direct) < 0.25 * abs(direct - base_only)

    assert export_lib.main([f"--run_dir={run}", f"--out={tmp_path / 'a'}", "--format=orbax"]) == 2
    assert "add --merge" in capsys.readouterr().err
    assert export_lib.main([f"--run_dir={run}", f"--out={tmp_path / 'a'}"]) == 0
    assert sorted(p.name for p in (tmp_path / "a").iterdir() if not p.name.startswith(".")) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert json.loads((tmp_path / "a" / "adapter_config.json").read_text())["base_model_name_or_path"] is None
    assert export_lib.main([f"--run_dir={run}", f"--out={tmp_path / 'm'}", "--merge", "--dtype=float32"]) == 0
    seed = "the adapters merged into the base initialised from seed 0, as trained (finetune.base_dtype=int8)"
    assert seed in capsys.readouterr().out  # no init_from: the base that trained is the only one
    export_state(trainer, state, tmp_path / "p", format="peft")
    a = (tmp_path / "a" / "adapter_model.safetensors").read_bytes()
    assert a == (tmp_path / "p" / "adapter_model.safetensors").read_bytes()
    with pytest.raises(ValueError, match="'peft' \\(the adapter\\)"):
        export_state(trainer, state, tmp_path / "q", format="gguf")


def test_the_base_is_the_seeds_whatever_key_starts_the_adapters():
    """A checkpoint holds no base: every reader rebuilds it from `seed`, so `init` must too."""
    cfg = lora_cfg(**EXACT)
    (t1, trains1), (t2, trains2) = built(cfg), built(cfg)
    s1, s2 = t1.init(jax.random.key(0)), t2.init(jax.random.key(7))
    b1 = jax.tree.leaves(trains1.base().units)
    b2 = jax.tree.leaves(trains2.base().units)
    assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(b1, b2))
    a1, a2 = jax.tree.leaves(s1.params), jax.tree.leaves(s2.params)
    assert not all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a1, a2))


def test_the_plan_counts_the_pinned_pool_and_three_streamed_blocks():
    from jaxzero.planner import memory
    from jaxzero.planner.partial import partial_bytes as lora_bytes

    cfg = lora_cfg(**{"model.name": "llama-3.1-70b", "finetune.base_dtype": "int8", "data.batch_size": "16",
                      "data.seq_len": "2048", "data.grad_accum": "1"})  # fmt: skip
    streamed, resident = lora_memory(cfg, True), lora_memory(cfg, False)
    b = lora_bytes(cfg, True)
    assert streamed.host == memory.pinned_pool_bytes(b.base_blocks) >= b.base_blocks
    block = b.base_blocks // cfg.model.num_layers
    assert streamed.activations - resident.activations == 3 * block


def test_end_of_run_samples_are_skipped_where_the_weights_would_not_fit(tmp_path, monkeypatch):
    from jaxzero.planner import runtime
    from jaxzero.run import samples

    monkeypatch.setattr(runtime, "host_memory_available", lambda: 1000)  # bytes: nothing fits
    out = io.StringIO()
    samples.print_samples(lora_cfg(run_dir=str(tmp_path)), out)
    assert "samples skipped" in out.getvalue() and "python -m jaxzero.generate" in out.getvalue()


def test_a_base_from_files_that_changed_since_training_is_refused(tmp_path, capsys):
    """Checkpoints hold no base: one rebuilt from `model.init_from` must be the files that trained.
    Resume, export and eval refuse a base whose files changed (or are gone), before any work."""
    import torch
    import transformers

    from jaxzero.cli import eval as eval_lib
    from jaxzero.cli import export as export_lib
    from jaxzero.data import write_tokens
    from jaxzero.storage.checkpoint_layout import read_meta

    def save_hf(seed: int) -> None:
        torch.manual_seed(seed)
        config = transformers.LlamaConfig(
            vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
        )  # fmt: skip
        transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")

    save_hf(0)
    over = {"model.name": f"hf:{tmp_path / 'hf'}", "run_dir": str(tmp_path / "run"), "steps": "2",
            "data.seq_len": "32", "model.num_layers": "2"}  # fmt: skip
    run = train_lib.train(lora_cfg(**over), io.StringIO())
    meta = read_meta(run / "checkpoints", 2)
    assert meta["base"]["init_from"] == str((tmp_path / "hf").absolute())
    assert export_lib.main([f"--run_dir={run}", f"--out={tmp_path / 'a'}"]) == 0  # the same files: fine

    save_hf(1)  # other weights saved over the base
    with pytest.raises(ConfigError, match="whose files have changed since"):
        train_lib.train(train_lib.configure([f"--run_dir={run}", "--steps=3"]).config, io.StringIO())
    assert export_lib.main([f"--run_dir={run}", f"--out={tmp_path / 'b'}"]) == 2
    assert "whose files have changed since" in capsys.readouterr().err
    tokens = tmp_path / "tokens"
    tokens.mkdir()
    write_tokens(tokens / "train.bin", np.random.default_rng(0).integers(0, 256, 512), "uint16")
    assert eval_lib.main([f"--run_dir={run}", f"--data.path={tokens}"]) == 2  # it returned a loss
    assert "whose files have changed since" in capsys.readouterr().err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2"]  # nothing written or removed

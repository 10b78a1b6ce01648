"""Full fine-tuning of part of a model (`finetune.freeze`): the trainer's gradients against whole-model
autodiff (a tied embedding too), a streamed frozen part against a resident one, checkpoints that hold
only the units that train, resumed == uninterrupted, the plan, and the refusals."""

import dataclasses
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_lora import batches, resident_then_streamed, trainer_of

from jaxzero.cli import train as train_lib
from jaxzero.config import ConfigError, TrainConfig
from jaxzero.config.checks import validate
from jaxzero.models import ModelParams, build_model
from jaxzero.numerics.objective import loss_fn, step_weight
from jaxzero.overrides import apply_overrides
from jaxzero.planner.partial import partial_bytes, partial_memory
from jaxzero.storage.checkpoint_masters import load_masters, read_saved_state

FREEZE = {
    "finetune.freeze": "embed,blocks:0-0",
    "model.num_layers": "3",
    "data.seq_len": "32",
    "data.batch_size": "4",
    "data.grad_accum": "2",
    "steps": "6",
    "optimizer.warmup_steps": "0",
    "optimizer.lr": "1e-3",
    "logging.log_every": "1",
    "logging.progress": "false",
    "logging.samples": "0",
}
EXACT = {"model.compute_dtype": "float32", "finetune.base_dtype": "float32"}
SGD = {"optimizer.name": "sgd", "optimizer.momentum": "0", "optimizer.weight_decay": "0",
       "optimizer.grad_clip": "0", "optimizer.lr": "1", "optimizer.schedule": "constant"}  # fmt: skip


def freeze_cfg(**over: str) -> TrainConfig:
    return apply_overrides(TrainConfig(), {**FREEZE, **over})


def units(tree: ModelParams) -> list:
    return tree.units()


@pytest.mark.parametrize(
    ("over", "trains"),
    [
        ({}, [2, 3, 4]),  # blocks 1, 2 and the head; no backward below block 1
        ({"model.name": "gpt2-tiny", "model.num_layers": "2", "finetune.freeze": "blocks:0-1"}, [0, 3]),
        ({"finetune.freeze": "blocks:0-2,head"}, [0]),  # an untied embedding: its lookup's gradient alone
        ({"finetune.freeze": "embed,blocks:0-2"}, [4]),  # the head alone: no backward through the blocks
    ],
    ids=["frozen-bottom", "tied-embedding", "untied-embedding", "head-only"],
)
def test_the_units_that_train_step_by_whole_model_autodiff(over, trains):
    """One SGD step at lr 1 moves each trainable unit by minus jax.grad of the objective over the
    whole model (frozen units fixed), two micro-batches; frozen units hold nothing in the state. With
    tied embeddings the embedding's gradient sums its lookup's and the head's."""
    cfg = freeze_cfg(**{**EXACT, **SGD, **over})
    model = build_model(cfg.model)
    trainer = trainer_of(cfg)
    state = trainer.init(jax.random.key(0))
    before = [jax.tree.map(np.asarray, u) for u in units(state.params)]
    assert [k for k, u in enumerate(before) if u] == trains
    full = model.init(jax.random.key(cfg.seed))  # the base and the starting units: the seed's init
    batch = batches(cfg, 1)[0]
    state, metrics = trainer.step(state, trainer.put_batch(batch))
    after = [jax.tree.map(np.asarray, u) for u in units(state.params)]

    weight = step_weight(jnp.asarray(batch)) / batch.shape[0]
    eot = None if cfg.data.cross_document_attention or cfg.data.eot_id < 0 else cfg.data.eot_id

    def loss(p):
        return sum(loss_fn(model, p, jnp.asarray(w), weight, eot_id=eot) for w in batch)

    with jax.default_matmul_precision("highest"):
        grads = units(jax.grad(loss)(full))
    ulp = np.finfo(np.float32).eps
    for k in trains:
        moved = jax.tree.leaves(jax.tree.map(lambda b, a: b - a, before[k], after[k]))
        for m, w, p in zip(moved, jax.tree.leaves(grads[k]), jax.tree.leaves(before[k])):
            # the new parameter is rounded to float32's grid at its size (norm scales are ~1)
            atol = 2 * ulp * np.max(np.abs(p)) + 2e-5 * np.max(np.abs(w))
            np.testing.assert_allclose(m, np.asarray(w), rtol=0, atol=atol)
    norm = np.sqrt(
        sum(float(np.sum(np.square(np.asarray(g)))) for k in trains for g in jax.tree.leaves(grads[k]))
    )
    assert np.isclose(float(metrics.grad_norm), norm, rtol=1e-4)


def test_a_streamed_frozen_part_trains_bitwise_as_a_resident_one():
    out = resident_then_streamed(freeze_cfg(**{"finetune.base_dtype": "bfloat16"}), 3)
    assert out[0][0] == out[1][0] and out[0][0][-1] < out[0][0][0]
    assert all(np.array_equal(a, b) for a, b in zip(out[0][1], out[1][1]))


def test_a_checkpoint_holds_the_units_that_train_and_a_resume_is_exact(tmp_path):
    over = {"optimizer.decay_steps": "6"}
    whole = train_lib.train(freeze_cfg(**over, run_dir=str(tmp_path / "whole")), io.StringIO())
    train_lib.train(freeze_cfg(**over, run_dir=str(tmp_path / "half"), steps="3"), io.StringIO())
    out = io.StringIO()
    train_lib.train(train_lib.configure([f"--run_dir={tmp_path / 'half'}", "--steps=6"]).config, out)
    assert "resumed from" in out.getvalue()
    a = read_saved_state(whole / "checkpoints" / "6")
    b = read_saved_state(tmp_path / "half" / "checkpoints" / "6")
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    saved = units(a["params"])
    assert [k for k, u in enumerate(saved) if u] == [2, 3, 4]  # blocks 1, 2, head: no frozen weights

    # The model a checkpoint reads as (samples, eval, export): the trained units, the frozen ones as
    # the seed drew them (bfloat16, as they trained).
    cfg, params, step = load_masters(whole)
    assert step == 6
    init = units(build_model(cfg.model).init(jax.random.key(cfg.seed)))
    read = units(params)
    for k in (2, 3, 4):
        assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(read[k]), jax.tree.leaves(saved[k])))
    for k in (0, 1):
        for x, y in zip(jax.tree.leaves(read[k]), jax.tree.leaves(init[k])):
            np.testing.assert_array_equal(
                x, np.asarray(jnp.asarray(y).astype(jnp.bfloat16).astype(jnp.float32))
            )


def test_the_plan_counts_what_trains_and_the_frozen_blocks():
    cfg = apply_overrides(TrainConfig(), {"model.name": "llama-7b", "finetune.freeze": "embed,blocks:0-23",
                                          "data.batch_size": "8", "data.seq_len": "2048"})  # fmt: skip
    b = partial_bytes(cfg, True)
    m = cfg.model
    per_block = 4096 * (4 * 4096 + 3 * 11008) + 2 * 4096  # llama-7b: q, k, v, o, gate, up, down, norms
    assert b.base_blocks == 24 * per_block * 2  # 24 frozen blocks in bf16
    assert b.trainable == 4 * (8 * per_block + 4096 + m.vocab_size * 4096)  # 8 blocks, the head
    streamed, resident = partial_memory(cfg, True), partial_memory(cfg, False)
    assert streamed.pinned == b.base_blocks and resident.pinned == 0
    assert resident.accelerator_state - streamed.accelerator_state == b.base_blocks
    whole = dataclasses.replace(cfg, finetune=dataclasses.replace(cfg.finetune, freeze="embed"))
    saved_inputs = 8 * 2048 * 4096 * 2  # one block's input, bf16
    assert (
        partial_bytes(whole, False).activations - partial_bytes(cfg, False).activations == 24 * saved_inputs
    )


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"finetune.freeze": "embed,blocks:0-2,head"}, "freezes every unit"),
        ({"finetune.freeze": " , "}, "names no unit"),
        ({"finetune.freeze": "blocks:\u00b2-3"}, "is not embed, head or blocks"),
        ({"finetune.freeze": "blocks:2-1"}, "'blocks:2-1' is not embed, head or blocks:A-B"),
        ({"finetune.freeze": "embedding"}, "'embedding' is not"),
        ({"finetune.method": "lora"}, "LoRA freezes the whole base already"),
        ({"offload.optimizer": "cpu"}, "offload.optimizer='cpu'"),
        ({"model.name": "gpt2-tiny", "finetune.base_dtype": "int8"}, "int8 quantises the llama family"),
    ],
)
def test_wrong_freeze_settings_are_refused_before_any_work(over, message):
    with pytest.raises(ConfigError, match=message):
        validate(freeze_cfg(**over))


def test_the_plan_counts_the_work_and_the_link_a_frozen_bottom_saves():
    from jaxzero.planner.partial import link_bytes, step_flops

    cfg = apply_overrides(TrainConfig(), {"model.name": "gpt2-small", "finetune.freeze": "embed,blocks:0-5",
                                          "data.batch_size": "8", "data.seq_len": "1024"})  # fmt: skip
    m = cfg.model
    n_block = 12 * m.hidden_size**2 + 13 * m.hidden_size  # attention 4 D^2, MLP 8 D^2, norms and biases
    tokens = 8 * 1024
    # blocks 0-5 below the lowest that trains: forward only; 6-11 train: 8 each; the tied projection
    # (the frozen embedding's): 4 x D x V
    want = (6 * 2 + 6 * 8) * n_block + 4 * m.hidden_size * m.vocab_size
    assert step_flops(cfg) / tokens == pytest.approx(want, rel=1e-3)
    per_block = partial_bytes(cfg, True).base_blocks // 6
    assert link_bytes(cfg) == 6 * per_block  # frozen blocks below the lowest cross once, forward
    upper = dataclasses.replace(cfg, finetune=dataclasses.replace(cfg.finetune, freeze="blocks:6-11"))
    assert link_bytes(upper) == 12 * per_block  # above it: forward and backward


def test_an_int8_frozen_part_trains():
    cfg = freeze_cfg(**{"finetune.base_dtype": "int8"})
    trainer = trainer_of(cfg, streamed=True)
    state = trainer.init(jax.random.key(0))
    losses = []
    for b in batches(cfg, 4):
        state, m = trainer.step(state, trainer.put_batch(b))
        losses.append(float(m.loss))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_the_programs_tflops_count_only_the_work_a_frozen_part_leaves():
    from jaxzero.models.sizes import block_matmul_params, flops_per_token
    from jaxzero.planner.partial import model_flops_per_token

    base = {"model.name": "llama-3.1-8b", "data.seq_len": "2048"}
    cfg = apply_overrides(TrainConfig(), {**base, "finetune.method": "lora"})
    m = cfg.model
    per_block, proj, attention = block_matmul_params(m), m.hidden_size * m.vocab_size, m.hidden_size * 2048
    # LoRA: forward and input gradients of every frozen matmul (4), attention's 12
    assert model_flops_per_token(cfg) == m.num_layers * (4 * per_block + 12 * attention) + 4 * proj
    head = apply_overrides(TrainConfig(), {**base, "finetune.freeze": "head"})
    # every block trains (6, as a full run counts) and the frozen untied projection 4 instead of 6
    assert model_flops_per_token(head) == flops_per_token(m, 2048) - 2 * proj


def test_an_export_writes_the_frozen_units_as_the_users_base_holds_them(tmp_path, capsys):
    """A freeze run over a float32 Hugging Face base trains its frozen units as a bfloat16 copy
    (`finetune.base_dtype`'s default); `export --dtype=float32` writes them as the user's files hold
    them, bit for bit, beside the units that trained, and says which base they come from.
    `export_state` writes the same files."""
    from safetensors.numpy import load_file
    from test_peft import torch_model

    from jaxzero import build_trainer, export_state, restore_state
    from jaxzero.cli import export as export_lib

    hf_dir = tmp_path / "hf"
    torch_model("llama").save_pretrained(hf_dir)
    settings = {
        "model.name": f"hf:{hf_dir}",
        "model.compute_dtype": "float32",
        "finetune.freeze": "embed,blocks:0",
        "data.source": "synthetic",
        "data.seq_len": "8",
        "data.batch_size": "4",
        "steps": "3",
        "optimizer.lr": "1e-2",
        "optimizer.warmup_steps": "0",
        "logging.progress": "false",
        "logging.samples": "0",
        "run_dir": str(tmp_path / "run"),
    }
    run = train_lib.train(apply_overrides(TrainConfig(), settings), io.StringIO())
    out = tmp_path / "out"
    assert export_lib.main([f"--run_dir={run}", f"--out={out}", "--dtype=float32"]) == 0
    printed = capsys.readouterr().out
    assert "the frozen units from the base read from" in printed and str(hf_dir) in printed, printed
    base, written = load_file(hf_dir / "model.safetensors"), load_file(out / "model.safetensors")
    frozen = [k for k in base if k == "model.embed_tokens.weight" or k.startswith("model.layers.0.")]
    trained = [k for k in base if k.startswith("model.layers.1.") and k.endswith("proj.weight")]
    assert frozen and trained
    for k in frozen:
        np.testing.assert_array_equal(written[k], base[k].astype(np.float32))
        assert not np.array_equal(base[k].astype(np.float32), base[k].astype(jnp.bfloat16).astype(np.float32))
    assert all(not np.array_equal(written[k], base[k]) for k in trained)
    cfg = train_lib.configure([f"--run_dir={run}"]).config
    trainer = build_trainer(cfg)
    export_state(trainer, restore_state(trainer, run)[0], tmp_path / "state", format="hf", dtype="float32")
    assert (tmp_path / "state" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()

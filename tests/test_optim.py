"""The optimizer as optax builds it: schedules, clipping by a given norm, the weight-decay mask, names."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxzero.config import ConfigError, OptimizerConfig, TrainConfig
from jaxzero.models import build_model
from jaxzero.numerics.optim import (
    build_optimizer,
    clip_by_norm,
    learning_rate_schedule,
    warmup_warning,
    weight_decay_mask,
)
from jaxzero.overrides import apply_overrides

FP32 = {"model.compute_dtype": "float32", "model.num_layers": "2", "data.seq_len": "32"}


def cfg_with(**over) -> TrainConfig:
    return apply_overrides(TrainConfig(), {**FP32, **{k.replace("__", "."): str(v) for k, v in over.items()}})


def test_schedule_values():
    cfg = cfg_with(optimizer__lr=1.0, optimizer__warmup_steps=10, optimizer__min_lr_ratio=0.1).optimizer
    cos = learning_rate_schedule(cfg, total_steps=110)
    assert float(cos(0)) == 0.0
    assert float(cos(5)) == pytest.approx(0.5)
    assert float(cos(10)) == pytest.approx(1.0)
    assert float(cos(60)) == pytest.approx(0.55, abs=1e-6)  # halfway down the cosine: (1 + 0.1) / 2
    assert float(cos(110)) == pytest.approx(0.1, abs=1e-6)
    lin = learning_rate_schedule(
        cfg_with(optimizer__lr=1.0, optimizer__warmup_steps=10, optimizer__schedule="linear").optimizer,
        total_steps=110,
    )
    assert float(lin(60)) == pytest.approx(0.55, abs=1e-6)
    const = learning_rate_schedule(
        cfg_with(optimizer__warmup_steps=0, optimizer__schedule="constant").optimizer, 50
    )
    assert float(const(0)) == float(const(49)) == pytest.approx(3e-3)


def test_clip_by_norm_matches_optax():
    tree = {"a": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(4)}
    norm = optax.tree.norm(tree)
    for max_norm in (0.5, 100.0):
        ref, _ = optax.clip_by_global_norm(max_norm).update(tree, optax.EmptyState())
        ours = clip_by_norm(tree, norm, max_norm)
        for x, y in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
            np.testing.assert_array_equal(x, y)


def test_weight_decay_mask_excludes_norms_biases_embeddings():
    for name in ("llama-tiny", "gpt2-tiny"):
        cfg = apply_overrides(TrainConfig(), {"model.name": name})
        model = build_model(cfg.model)
        shapes = jax.eval_shape(model.init, jax.random.key(0))
        mask = weight_decay_mask(shapes)
        assert not any(jax.tree.leaves(mask.embed))
        flat = jax.tree_util.tree_flatten_with_path(mask.blocks[0])[0]
        for path, decays in flat:
            leaf = jax.tree_util.keystr(path)
            assert decays == ("kernel" in leaf), leaf


def test_optimizer_names_build():
    for name in ("adamw", "lion", "sgd"):
        build_optimizer(cfg_with(optimizer__name=name).optimizer, 10)
    # --optimizer.name=adam takes Adam's own default, no decay (adamw's default refused it); a decay
    # asked for by name is refused, as is one set on an OptimizerConfig built by hand.
    assert cfg_with(optimizer__name="adam").optimizer.weight_decay == 0.0
    build_optimizer(cfg_with(optimizer__name="adam").optimizer, 10)
    with pytest.raises(ConfigError, match="optimizer.name=adam has no weight decay"):
        build_optimizer(cfg_with(optimizer__name="adam", optimizer__weight_decay=0.1).optimizer, 10)
    with pytest.raises(ConfigError, match="optimizer.name=adam has no weight decay"):
        build_optimizer(OptimizerConfig(name="adam"), 10)
    build_optimizer(cfg_with(optimizer__name="adam", optimizer__weight_decay=0).optimizer, 10)


def test_a_run_shorter_than_its_warmup_is_warned_with_the_numbers():
    """steps=5 with the default 20 warmup steps never reaches the peak learning rate: the warning says
    what the last step's rate is; a run past its warmup gets none."""
    cfg = OptimizerConfig(lr=3e-3, warmup_steps=20)
    text = warmup_warning(cfg, steps=5, schedule_steps=5)
    assert text == (
        "optimizer.warmup_steps=20 >= steps=5: the learning rate never reaches optimizer.lr=0.003; the "
        "last step's is 0.0006 (20% of it). Lower optimizer.warmup_steps (e.g. "
        "--optimizer.warmup_steps=0) or raise steps."
    )
    assert warmup_warning(cfg, steps=20, schedule_steps=20) is not None  # step 20 applies count 19
    assert warmup_warning(cfg, steps=21, schedule_steps=21) is None
    log = OptimizerConfig(lr=1e-3, warmup_steps=10, warmup_type="log")  # DeepSpeed's log warmup
    assert "the last step's is 0.000699 (70% of it)" in warmup_warning(log, steps=5, schedule_steps=5)

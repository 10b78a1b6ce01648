"""A researcher's own Flax model and optax transformation (`build_trainer(cfg, model=..., optimizer=...)`):
trained resident and streamed alike, and refused where the config does not describe them.

The model here is not jaxzero's: a causal transformer without position encodings, its blocks plain
`flax.linen` modules (LayerNorm, grouped-query attention, a GELU-gated MLP), laid out so that its
embedding, blocks and head have the parameter counts of the `llama` shape its `cfg.model` gives.
"""

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_offload import STEPS, TOLERANCE, rel, tiny

from jaxzero.config import ConfigError, ModelConfig
from jaxzero.data import build_data
from jaxzero.models import ModelParams, init_params
from jaxzero.plan import placement
from jaxzero.trainer import build_trainer


class Block(nn.Module):
    """Pre-norm causal attention (no positions) and a GELU-gated MLP, (B, S, D) -> (B, S, D)."""

    cfg: ModelConfig
    out_bias: bool = False  # one array more than cfg.model describes (the refusal test)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c, dt = self.cfg, jnp.dtype(self.cfg.compute_dtype)
        batch, seq, _ = x.shape
        dense = lambda width, name, bias=False: nn.Dense(width, use_bias=bias, dtype=dt, name=name)  # noqa: E731
        h = nn.LayerNorm(use_bias=False, dtype=dt, name="norm_attn")(x)
        q = dense(c.num_heads * c.head_dim, "query")(h).reshape(batch, seq, c.num_heads, c.head_dim)
        kv_shape = (batch, seq, c.num_kv_heads, c.head_dim)
        k = jnp.repeat(
            dense(c.num_kv_heads * c.head_dim, "key")(h).reshape(kv_shape), c.num_heads // c.num_kv_heads, 2
        )
        v = jnp.repeat(
            dense(c.num_kv_heads * c.head_dim, "value")(h).reshape(kv_shape), c.num_heads // c.num_kv_heads, 2
        )
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(c.head_dim)
        scores = jnp.where(jnp.tril(jnp.ones((seq, seq), bool)), scores, -1e30)
        mixed = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores).astype(dt), v)
        x = x + dense(c.hidden_size, "out", self.out_bias)(mixed.reshape(batch, seq, -1))
        h = nn.LayerNorm(use_bias=False, dtype=dt, name="norm_mlp")(x)
        gated = nn.gelu(dense(c.intermediate_size, "gate")(h)) * dense(c.intermediate_size, "up")(h)
        return x + dense(c.hidden_size, "down")(gated)


class Head(nn.Module):
    """Final LayerNorm and an untied projection: (B, S, D) -> float32 logits (B, S, V)."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dt = jnp.dtype(self.cfg.compute_dtype)
        h = nn.LayerNorm(use_bias=False, dtype=dt, name="norm")(x)
        return nn.Dense(self.cfg.vocab_size, use_bias=False, dtype=dt, name="unembed")(h).astype(jnp.float32)


class NoPositionTransformer:
    """The block protocol (`jaxzero.models.base.Model`) over the modules above; training only."""

    def __init__(self, config: ModelConfig, out_bias: bool = False):
        self.config = config
        self._embed = nn.Embed(config.vocab_size, config.hidden_size, dtype=jnp.dtype(config.compute_dtype))
        self._block = Block(config, out_bias)
        self._head = Head(config)

    def init(self, key: jax.Array) -> ModelParams:
        return init_params(self, key)  # one key per unit, as the offload engine initialises them

    def init_embed(self, key: jax.Array):
        return self._embed.init(key, jnp.zeros((1, 1), jnp.int32))["params"]

    def init_block(self, key: jax.Array):
        return self._block.init(key, jnp.zeros((1, 1, self.config.hidden_size)))["params"]

    def init_head(self, key: jax.Array):
        return self._head.init(key, jnp.zeros((1, 1, self.config.hidden_size)))["params"]

    def embed(self, params, tokens: jax.Array) -> jax.Array:
        return self._embed.apply({"params": params}, tokens)

    def block(self, params, x: jax.Array) -> jax.Array:
        return self._block.apply({"params": params}, x)

    def head(self, params, embed_params, x: jax.Array) -> jax.Array:
        return self._head.apply({"params": params}, x)


def own_optimizer() -> optax.GradientTransformation:
    """Adam's moments and a cosine schedule: per-parameter, with state per unit (moments, counts)."""
    return optax.chain(
        optax.scale_by_adam(), optax.scale_by_learning_rate(optax.cosine_decay_schedule(1e-2, STEPS))
    )


def train(cfg, model, optimizer):
    mesh = placement.make_mesh(jax.devices()[:1])
    trainer = build_trainer(cfg, mesh, model=model, optimizer=optimizer)
    batches = build_data(cfg.data, cfg.model.vocab_size, cfg.seed).train_iter()
    state = trainer.init(jax.random.key(cfg.seed))
    losses, norms = [], []
    for _ in range(cfg.steps):
        state, m = trainer.step(state, trainer.put_batch(next(batches)))
        m = jax.device_get(m)
        losses.append(float(m.loss))
        norms.append(float(m.grad_norm))
    return trainer, jax.device_get(state.params), np.array(losses), np.array(norms)


def test_own_model_and_optimizer_train_streamed_as_resident():
    cfg = tiny("llama", "float32")
    model = NoPositionTransformer(cfg.model)
    ref, ref_params, ref_losses, ref_norms = train(cfg, model, own_optimizer())
    streamed = tiny("llama", "float32", **{"offload.optimizer": "cpu", "offload.params": "cpu"})
    tr, params, losses, norms = train(streamed, model, own_optimizer())
    assert ref.plan.host_update is None and ref.model is model and tr.model is model
    assert tr.plan.host_update is not None and not tr.plan.host_update.fused  # optax on XLA:CPU
    param_tol, loss_tol = TOLERANCE["float32"]
    assert ref_norms[0] > 0.5, "clipping (jaxzero's, before the transformation) must be active"
    np.testing.assert_allclose(losses, ref_losses, atol=loss_tol, rtol=0)
    np.testing.assert_allclose(norms, ref_norms, rtol=param_tol)
    assert losses[-1] < losses[0]
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    assert any(jax.tree_util.keystr(p).endswith("['gate']['kernel']") for p, _ in flat)  # ours
    for (path, a), b in zip(flat, jax.tree.leaves(ref_params)):
        assert rel(a, b) < param_tol, jax.tree_util.keystr(path)


@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_a_model_unlike_its_config_is_refused(offload):
    cfg = tiny("llama", "float32", **{"offload.optimizer": offload})
    mesh = placement.make_mesh(jax.devices()[:1])
    with pytest.raises(ConfigError, match="the memory planner counts cfg.model's shape"):
        build_trainer(cfg, mesh, model=NoPositionTransformer(cfg.model, out_bias=True))
    other = dataclasses.replace(cfg.model, intermediate_size=256)
    with pytest.raises(ConfigError, match="must carry the trainer's cfg.model"):
        build_trainer(cfg, mesh, model=NoPositionTransformer(other))


def test_an_optimizer_keeping_more_state_than_the_config_counts_is_refused():
    cfg = tiny("llama", "float32", **{"optimizer.name": "lion"})  # the planner counts one moment
    mesh = placement.make_mesh(jax.devices()[:1])
    with pytest.raises(ConfigError, match="bytes of state per parameter"):
        build_trainer(cfg, mesh, optimizer=own_optimizer())  # Adam's two


def test_the_disk_tier_refuses_an_optimizer_of_ones_own(tmp_path):
    over = {"offload.optimizer": "disk", "offload.params": "cpu", "offload.disk_path": str(tmp_path)}
    cfg = tiny("llama", "float32", **over)
    with pytest.raises(ConfigError, match="implement only jaxzero.s named optimizers"):
        build_trainer(cfg, placement.make_mesh(jax.devices()[:1]), optimizer=own_optimizer())


def test_a_stateless_optimizer_of_ones_own_saves_per_unit_under_either_trainer():
    """Plain SGD's state holds nothing param-shaped: the saved form still has one state per unit, and
    a state saved by the resident trainer starts the offload trainer and comes back the same."""
    resident_cfg = tiny("llama", "float32")
    offload_cfg = tiny("llama", "float32", **{"offload.optimizer": "cpu", "offload.params": "cpu"})
    model, tx, mesh = (
        NoPositionTransformer(resident_cfg.model),
        optax.sgd(1e-2),
        placement.make_mesh(jax.devices()[:1]),
    )
    resident = build_trainer(resident_cfg, mesh, model=model, optimizer=tx)
    offload = build_trainer(offload_cfg, mesh, model=model, optimizer=tx)

    def placed(trainer, saved):  # as a restore places them
        targets = trainer.abstract_saved_state()
        return jax.tree.map(lambda x, t: jax.device_put(np.asarray(x), t.sharding), saved, targets)

    saved = jax.device_get(resident.saved_state(resident.init(jax.random.key(0))))
    assert len(saved["opt_state"].blocks) == resident_cfg.model.num_layers
    back = jax.device_get(offload.saved_state(offload.from_saved_state(placed(offload, saved))))
    assert jax.tree.structure(back) == jax.tree.structure(saved)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(saved)):
        np.testing.assert_array_equal(a, b)
    resident.from_saved_state(placed(resident, back))

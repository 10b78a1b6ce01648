"""A researcher's own Flax NNX model (`jaxzero.models.nnx.from_nnx`) trained through
`build_trainer(cfg, model=...)`: its first loss is the NNX modules' own (merged and called), streamed
equals resident, a resumed run equals the uninterrupted one, and models the engines cannot train are
refused with what to change.

The model here is not jaxzero's: a causal transformer without position encodings, its blocks NNX
modules (RMSNorm, grouped-query attention, a SiLU-gated MLP), laid out so that its embedding, blocks
and head have the parameter counts of the `llama` shape its `cfg.model` gives.
"""

import functools
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_offload import TOLERANCE, rel, tiny

from jaxzero.config import ConfigError, ModelConfig
from jaxzero.data import build_data
from jaxzero.models.nnx import from_nnx
from jaxzero.numerics.objective import document_segments
from jaxzero.plan import placement
from jaxzero.storage.state_io import restore_state, save_state
from jaxzero.trainer import build_trainer

OFFLOAD = {"offload.optimizer": "cpu", "offload.params": "cpu"}


class Block(nnx.Module):
    """Pre-norm causal attention (no positions) and a SiLU-gated MLP, (B, S, D) -> (B, S, D)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, width: int = 0):
        d, dt = cfg.hidden_size, jnp.dtype(cfg.compute_dtype)
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        linear = functools.partial(nnx.Linear, use_bias=False, dtype=dt, rngs=rngs)
        self.norm_attn = nnx.RMSNorm(d, dtype=dt, rngs=rngs)
        self.query = linear(d, cfg.num_heads * cfg.head_dim)
        self.key = linear(d, cfg.num_kv_heads * cfg.head_dim)
        self.value = linear(d, cfg.num_kv_heads * cfg.head_dim)
        self.out = linear(cfg.num_heads * cfg.head_dim, d)
        self.norm_mlp = nnx.RMSNorm(d, dtype=dt, rngs=rngs)
        width = width or cfg.intermediate_size
        self.gate, self.up, self.down = linear(d, width), linear(d, width), linear(width, d)

    def __call__(self, x: jax.Array, segments: jax.Array | None = None) -> jax.Array:
        batch, seq, _ = x.shape
        h = self.norm_attn(x)
        q = self.query(h).reshape(batch, seq, self.heads, self.head_dim)
        repeat = lambda t: jnp.repeat(  # noqa: E731
            t.reshape(batch, seq, self.kv_heads, self.head_dim), self.heads // self.kv_heads, 2
        )
        k, v = repeat(self.key(h)), repeat(self.value(h))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(self.head_dim)
        mask = jnp.tril(jnp.ones((seq, seq), bool))[None]
        if segments is not None:
            mask = mask & (segments[:, :, None] == segments[:, None, :])
        scores = jnp.where(mask[:, None], scores, -1e30)
        mixed = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores).astype(x.dtype), v)
        x = x + self.out(mixed.reshape(batch, seq, -1))
        h = self.norm_mlp(x)
        return x + self.down(nnx.silu(self.gate(h)) * self.up(h))


class Head(nnx.Module):
    """Final RMSNorm and an untied projection: (B, S, D) -> logits (B, S, V)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        dt = jnp.dtype(cfg.compute_dtype)
        self.norm = nnx.RMSNorm(cfg.hidden_size, dtype=dt, rngs=rngs)
        self.unembed = nnx.Linear(cfg.hidden_size, cfg.vocab_size, use_bias=False, dtype=dt, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.unembed(self.norm(x))


class TiedHead(nnx.Module):
    """Final RMSNorm and the embedding's transpose: (B, S, D) -> logits (B, S, V)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.norm = nnx.RMSNorm(cfg.hidden_size, dtype=jnp.dtype(cfg.compute_dtype), rngs=rngs)

    def __call__(self, x: jax.Array, embed: nnx.Embed) -> jax.Array:
        return embed.attend(self.norm(x))


class PlainBlock(Block):
    """A block called as `block(x)` only: it cannot keep documents apart."""

    def __call__(self, x: jax.Array) -> jax.Array:
        return super().__call__(x)


def embedding(cfg: ModelConfig, *, rngs: nnx.Rngs) -> nnx.Embed:
    return nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=jnp.dtype(cfg.compute_dtype), rngs=rngs)


def head_of(cfg: ModelConfig):
    return functools.partial(TiedHead if cfg.tie_embeddings else Head, cfg)


def nnx_model(cfg: ModelConfig, block=None):
    return from_nnx(
        cfg,
        embed=functools.partial(embedding, cfg),
        block=block or functools.partial(Block, cfg),
        head=head_of(cfg),
    )


def reference_loss(cfg: ModelConfig, params, batch: np.ndarray, eot_id: int | None = None) -> float:
    """The mean cross-entropy of int32 batch (..., S+1) by the NNX modules themselves, merged with
    `params` and called in sequence (documents kept apart at `eot_id`): no jaxzero model code."""
    graph = lambda make: nnx.split(make(rngs=nnx.Rngs(0)), nnx.Param)[0]  # noqa: E731
    embed = nnx.merge(graph(functools.partial(embedding, cfg)), params.embed)
    window = jnp.asarray(batch).reshape(-1, batch.shape[-1])
    segments = None if eot_id is None else document_segments(window, eot_id)
    x = embed(window[:, :-1])
    for p in params.blocks:
        x = nnx.merge(graph(functools.partial(Block, cfg)), p)(x, segments)
    head = nnx.merge(graph(head_of(cfg)), params.head)
    logits = head(x, embed) if cfg.tie_embeddings else head(x)
    return float(optax.softmax_cross_entropy_with_integer_labels(logits, window[:, 1:]).mean())


def batches(cfg, n: int) -> list[np.ndarray]:
    it = build_data(cfg.data, cfg.model.vocab_size, cfg.seed).train_iter()
    return [next(it) for _ in range(n)]


def steps(trainer, state, todo):
    losses, norms = [], []
    for batch in todo:
        state, m = trainer.step(state, trainer.put_batch(batch))
        m = jax.device_get(m)
        losses.append(float(m.loss))
        norms.append(float(m.grad_norm))
    return state, np.array(losses), np.array(norms)


def trainer_of(cfg):
    return build_trainer(cfg, placement.make_mesh(jax.devices()[:1]), model=nnx_model(cfg.model))


@pytest.fixture(scope="module")
def runs():
    """(trainer, first params, final params, losses, grad norms) of the NNX model, resident and
    offloaded, over the same batches."""
    out = {}
    for mode, over in (("resident", {}), ("offload", OFFLOAD)):
        cfg = tiny("llama", "float32", **over)
        trainer = trainer_of(cfg)
        state = trainer.init(jax.random.key(cfg.seed))
        first = jax.device_get(state.params) if mode == "resident" else None
        state, losses, norms = steps(trainer, state, batches(cfg, cfg.steps))
        out[mode] = (cfg, trainer, first, jax.device_get(state.params), losses, norms)
    return out


def test_the_nnx_model_trains_resident_with_its_own_loss(runs):
    cfg, trainer, first, _, losses, _ = runs["resident"]
    assert trainer.plan.host_update is None
    flat = jax.tree_util.tree_flatten_with_path(first)[0]
    assert any(jax.tree_util.keystr(p).endswith("['gate']['kernel']") for p, _ in flat)  # the NNX names
    assert abs(losses[0] - reference_loss(cfg.model, first, batches(cfg, 1)[0])) < TOLERANCE["float32"][1]
    assert losses[-1] < losses[0]


def test_the_nnx_model_trains_streamed_as_resident(runs):
    *_, ref_params, ref_losses, ref_norms = runs["resident"]
    _, trainer, _, params, losses, norms = runs["offload"]
    assert trainer.plan.host_update is not None
    param_tol, loss_tol = TOLERANCE["float32"]
    np.testing.assert_allclose(losses, ref_losses, atol=loss_tol, rtol=0)
    np.testing.assert_allclose(norms, ref_norms, rtol=param_tol)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    for (path, a), b in zip(flat, jax.tree.leaves(ref_params)):
        assert rel(a, b) < param_tol, jax.tree_util.keystr(path)


def test_a_resumed_nnx_run_equals_the_uninterrupted_one(runs, tmp_path):
    cfg, _, _, final, losses, norms = runs["offload"]
    todo = batches(cfg, cfg.steps)
    trainer = trainer_of(cfg)
    state, before, _ = steps(trainer, trainer.init(jax.random.key(cfg.seed)), todo[:2])
    save_state(trainer, state, tmp_path / "run", step=2)
    resumed = trainer_of(cfg)
    state, step, _ = restore_state(resumed, tmp_path / "run")
    state, after, after_norms = steps(resumed, state, todo[2:])
    assert step == 2
    np.testing.assert_array_equal(np.concatenate([before, after]), losses)
    np.testing.assert_array_equal(after_norms, norms[2:])
    for a, b in zip(jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(final)):
        np.testing.assert_array_equal(a, b)


def test_a_tied_nnx_model_keeps_documents_apart():
    eot = 10
    cfg = tiny("llama", "float32", **{"model.tie_embeddings": "true", "data.eot_id": str(eot), "steps": "1"})
    trainer = trainer_of(cfg)
    state = trainer.init(jax.random.key(cfg.seed))
    first = jax.device_get(state.params)
    (batch,) = batches(cfg, 1)
    _, losses, _ = steps(trainer, state, [batch])
    apart, across = reference_loss(cfg.model, first, batch, eot), reference_loss(cfg.model, first, batch)
    tol = TOLERANCE["float32"][1]
    assert abs(apart - across) > 10 * tol  # the documents' bounds change the loss
    assert abs(losses[0] - apart) < tol
    plain = from_nnx(
        cfg.model,
        embed=functools.partial(embedding, cfg.model),
        block=functools.partial(PlainBlock, cfg.model),
        head=head_of(cfg.model),
    )
    with pytest.raises(ConfigError, match="takes no `segments`"):
        build_trainer(cfg, placement.make_mesh(jax.devices()[:1]), model=plain)


def test_an_nnx_model_whose_blocks_differ_is_refused():
    cfg = tiny("llama", "float32")
    widths = iter([0, 256] * cfg.model.num_layers)  # the second block's MLP is narrower
    model = nnx_model(cfg.model, block=lambda rngs: Block(cfg.model, rngs=rngs, width=next(widths)))
    unlike = r"the block factory built a module unlike the one it built first \(down.kernel: \(\(384, 128\)"
    with pytest.raises(ConfigError, match=unlike):
        build_trainer(cfg, placement.make_mesh(jax.devices()[:1]), model=model)


def test_an_nnx_module_with_state_besides_parameters_is_refused():
    cfg = tiny("llama", "float32").model

    class Dropping(Block):
        def __init__(self, cfg, *, rngs):
            super().__init__(cfg, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)

    with pytest.raises(ConfigError, match=r"holds state other than nnx.Param: drop\.rngs"):
        nnx_model(cfg, block=functools.partial(Dropping, cfg))


def test_the_docs_example_trains(capsys):
    """docs/library.md's NNX example, verbatim: it builds, trains streamed and prints its metrics."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "library.md").read_text()
    code = text.split("## Your own model in Flax NNX")[1].split("```python")[1].split("```")[0]
    exec(compile(code, "docs/library.md", "exec"), {"__name__": "docs_example"})
    assert "StepMetrics(loss=" in capsys.readouterr().out


def test_a_block_of_listed_modules_keeps_its_order():
    """An `nnx.List`'s indices become string keys (as checkpoints name paths) and merge back in order."""
    cfg = tiny("llama", "float32").model

    class Stack(nnx.Module):
        def __init__(self, *, rngs: nnx.Rngs):
            self.layers = nnx.List([nnx.Linear(8, 8, rngs=rngs) for _ in range(3)])

        def __call__(self, x: jax.Array) -> jax.Array:
            for layer in self.layers:
                x = jnp.tanh(layer(x))
            return x

    model = from_nnx(cfg, embed=Stack, block=Stack, head=Stack)
    params = model.init_block(jax.random.key(1))
    assert sorted(params["layers"]) == ["0", "1", "2"]
    x = jnp.linspace(-1.0, 1.0, 16).reshape(2, 8)
    direct = Stack(rngs=nnx.Rngs(jax.random.key(1)))  # the same module, from the same key, called
    layers = params["layers"]
    assert not np.array_equal(layers["0"]["kernel"], layers["1"]["kernel"])  # so their order shows
    np.testing.assert_array_equal(model.block(params, x), direct(x))

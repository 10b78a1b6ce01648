"""The resident reference trainer: accumulation, clipping, sharding, bf16 moments, the loss at init."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxzero.config import TrainConfig
from jaxzero.models import build_model
from jaxzero.numerics.objective import loss_fn
from jaxzero.overrides import apply_overrides
from jaxzero.plan import placement
from jaxzero.resident import averaged_grads
from jaxzero.trainer import build_trainer

FP32 = {"model.compute_dtype": "float32", "model.num_layers": "2", "data.seq_len": "32"}


def cfg_with(**over) -> TrainConfig:
    return apply_overrides(TrainConfig(), {**FP32, **{k.replace("__", "."): str(v) for k, v in over.items()}})


def random_batch(cfg: TrainConfig, key: int = 0) -> np.ndarray:
    d = cfg.data
    shape = (d.grad_accum, d.batch_size // d.grad_accum, d.seq_len + 1)
    return np.random.default_rng(key).integers(0, cfg.model.vocab_size, shape, dtype=np.int32)


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def test_grad_accumulation_equals_one_big_batch():
    cfg = cfg_with(data__batch_size=8)
    model = build_model(cfg.model)
    params = model.init(jax.random.key(0))
    big = random_batch(cfg)  # (1, 8, S+1)
    loss1, g1 = jax.jit(lambda p, b: averaged_grads(model, p, b)[:2])(params, big)
    loss4, g4 = jax.jit(lambda p, b: averaged_grads(model, p, b)[:2])(params, big.reshape(4, 2, -1))
    assert abs(float(loss1) - float(loss4)) < 1e-5
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g4)):
        assert rel(b, a) < 1e-5


def test_training_with_accumulation_matches_without():
    """Whole optimizer steps: grad_accum=4 over the same 8 sequences equals grad_accum=1."""
    losses = {}
    for accum in (1, 4):
        cfg = cfg_with(data__batch_size=8, data__grad_accum=accum, steps=3)
        tr = build_trainer(cfg, placement.make_mesh(jax.devices()[:1]))
        state = tr.init(jax.random.key(0))
        out = []
        for k in range(3):
            batch = random_batch(cfg_with(data__batch_size=8), key=k).reshape(accum, 8 // accum, -1)
            state, m = tr.step(state, tr.put_batch(batch))
            out.append(float(m.loss))
        losses[accum] = (out, jax.device_get(state.params))
    np.testing.assert_allclose(losses[1][0], losses[4][0], rtol=2e-5)
    for a, b in zip(jax.tree.leaves(losses[1][1]), jax.tree.leaves(losses[4][1])):
        assert rel(b, a) < 1e-4


def test_clipping_bounds_the_update():
    """With SGD (lr 1, no momentum) the update is the clipped gradient: its norm is the clip value."""
    cfg = cfg_with(
        optimizer__name="sgd",
        optimizer__momentum=0,
        optimizer__lr=1.0,
        optimizer__warmup_steps=0,
        optimizer__schedule="constant",
        optimizer__weight_decay=0,
        optimizer__grad_clip=0.01,
        steps=1,
    )
    tr = build_trainer(cfg, placement.make_mesh(jax.devices()[:1]))
    state = tr.init(jax.random.key(0))
    before = jax.device_get(state.params)
    state, m = tr.step(state, tr.put_batch(random_batch(cfg)))
    after = jax.device_get(state.params)
    delta = jax.tree.map(lambda a, b: a - b, after, before)
    assert float(m.grad_norm) > 0.01  # clipping was active
    assert float(optax.tree.norm(delta)) == pytest.approx(0.01, rel=1e-4)


def test_sharded_over_four_devices_equals_one():
    assert len(jax.devices()) == 4
    results = []
    for devices in (jax.devices()[:1], jax.devices()):
        cfg = cfg_with(data__batch_size=8, data__grad_accum=2, steps=3)
        tr = build_trainer(cfg, placement.make_mesh(devices))
        state = tr.init(jax.random.key(1))
        losses = []
        for k in range(3):
            state, m = tr.step(state, tr.put_batch(random_batch(cfg, key=k)))
            losses.append(float(m.loss))
        val = float(tr.eval_loss(state, tr.put_eval_batch(random_batch(cfg, key=9)[0])))
        results.append((losses, val, jax.device_get(state.params)))
        if len(devices) == 4:
            assert state.params.blocks[0]["mlp"]["up_proj"]["kernel"].sharding.is_fully_replicated
    (l1, v1, p1), (l4, v4, p4) = results
    np.testing.assert_allclose(l1, l4, rtol=1e-5)
    assert v1 == pytest.approx(v4, rel=1e-5)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p4)):
        assert rel(b, a) < 1e-5


def test_loss_at_init_is_log_vocab():
    cfg = cfg_with()
    model = build_model(cfg.model)
    params = model.init(jax.random.key(0))
    loss = float(loss_fn(model, params, jnp.asarray(random_batch(cfg)[0])))
    assert loss == pytest.approx(np.log(cfg.model.vocab_size), rel=0.02)


def test_bf16_moments_halve_the_state_and_track_float32_moments():
    """optimizer.state_dtype=bfloat16 stores AdamW's moments in bf16 (each update still computed in
    float32). Fixed tolerance, from the analysis: each stored moment is rounded to 2^-9 relative, which
    moves each update by a few 1e-3 relative; after 4 steps that is < 1e-2 of each leaf's change."""
    results = {}
    for dtype in ("float32", "bfloat16"):
        cfg = cfg_with(optimizer__state_dtype=dtype, optimizer__lr=1e-2, optimizer__warmup_steps=0, steps=4)
        tr = build_trainer(cfg, placement.make_mesh(jax.devices()[:1]))
        state = tr.init(jax.random.key(0))
        init = jax.device_get(state.params)
        losses = []
        for k in range(4):
            state, m = tr.step(state, tr.put_batch(random_batch(cfg, key=k)))
            losses.append(float(m.loss))
        moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
        assert {x.dtype for x in moments} == {np.dtype(jnp.dtype(dtype))}
        results[dtype] = (losses, init, jax.device_get(state.params), sum(x.nbytes for x in moments))
    (l32, init, p32, b32), (l16, _, p16, b16) = results["float32"], results["bfloat16"]
    assert b16 * 2 == b32
    np.testing.assert_allclose(l16, l32, atol=1e-3, rtol=0)
    for a, b, p0 in zip(jax.tree.leaves(p16), jax.tree.leaves(p32), jax.tree.leaves(init)):
        assert np.linalg.norm(a - b) <= 1e-2 * np.linalg.norm(b - p0) + 1e-12


# -------------------------------------------------------------------------------------------------
# Loss masks: targets marked ~id are read as input and not counted
# -------------------------------------------------------------------------------------------------


def marked(batch: np.ndarray, key: int = 1, keep: float = 0.4) -> np.ndarray:
    """`batch` with a random ~60% of its tokens marked not-a-target (~id)."""
    counted = np.random.default_rng(key).random(batch.shape) < keep
    return np.where(counted, batch, ~batch).astype(np.int32)


def reference_loss(model, params, window: np.ndarray) -> float:
    """The masked mean cross-entropy by hand: float64 log-softmax of the model's logits, summed over
    the counted targets only, divided by their count."""
    ids = np.where(window < 0, ~window, window)
    logits = np.asarray(
        jax.jit(lambda p, x: model.head(p.head, p.embed, _trunk(model, p, x)))(params, ids[:, :-1]),
        np.float64,
    )
    logp = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )
    targets, counted = ids[:, 1:], window[:, 1:] >= 0
    nll = -np.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return float(nll[counted].sum() / counted.sum())


def _trunk(model, params, x):
    h = model.embed(params.embed, x)
    for p in params.blocks:
        h = model.block(p, h)
    return h


def test_masked_loss_is_the_mean_over_the_counted_targets_only():
    cfg = cfg_with(data__batch_size=4)
    model = build_model(cfg.model)
    params = model.init(jax.random.key(0))
    window = marked(random_batch(cfg)[0])
    got = float(jax.jit(lambda p, w: loss_fn(model, p, w))(params, window))
    assert got == pytest.approx(reference_loss(model, params, window), rel=1e-5)
    # the marks change the loss: the unmarked window's mean differs
    plain = np.where(window < 0, ~window, window)
    assert abs(float(loss_fn(model, params, plain)) - got) > 1e-3


def test_masked_micro_batches_weigh_by_their_counted_targets():
    """grad_accum=4 over micro-batches with different numbers of counted targets gives the loss and
    gradients of the one large batch: the step's mean over all its counted targets, not the mean of
    the micro-batches' means."""
    cfg = cfg_with(data__batch_size=8)
    model = build_model(cfg.model)
    params = model.init(jax.random.key(0))
    big = random_batch(cfg)
    keep = np.repeat([0.9, 0.1, 0.5, 0.3], 2)[None, :, None]  # uneven counts per micro-batch
    big = np.where(np.random.default_rng(3).random(big.shape) < keep, big, ~big).astype(np.int32)
    loss1, g1 = jax.jit(lambda p, b: averaged_grads(model, p, b)[:2])(params, big)
    loss4, g4 = jax.jit(lambda p, b: averaged_grads(model, p, b)[:2])(params, big.reshape(4, 2, -1))
    assert float(loss1) == pytest.approx(reference_loss(model, params, big[0]), rel=1e-5)
    assert abs(float(loss1) - float(loss4)) < 1e-5
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g4)):
        assert rel(b, a) < 1e-5
    means = [reference_loss(model, params, m) for m in big.reshape(4, 2, -1)]
    assert abs(np.mean(means) - float(loss1)) > 1e-3  # what weighing micro-batches equally would give


@pytest.mark.parametrize(
    "over",
    [
        {"offload.optimizer": "cpu", "offload.params": "cpu"},
        {"offload.optimizer": "cpu", "offload.params": "cpu", "offload.device_state_units": "2"},
    ],
)
def test_offloaded_masked_training_matches_resident(over):
    """The offload engine's streamed loss weighs masked micro-batches as the resident trainer does."""
    base = {"data.batch_size": "8", "data.grad_accum": "2", "optimizer.lr": "1e-2", "steps": "3"}
    runs = []
    for extra in ({}, over):
        cfg = apply_overrides(TrainConfig(), {**FP32, **base, **extra})
        tr = build_trainer(cfg, placement.make_mesh(jax.devices()[:1]))
        state = tr.init(jax.random.key(0))
        losses = []
        for k in range(3):
            batch = marked(random_batch(cfg, key=k), key=10 + k, keep=0.5)
            state, m = tr.step(state, tr.put_batch(batch))
            losses.append(float(m.loss))
        val = tr.evaluate(state, [marked(random_batch(cfg, key=9)[0], key=9)])
        runs.append((losses, val, jax.device_get(state.params)))
    (l0, v0, p0), (l1, v1, p1) = runs
    np.testing.assert_allclose(l1, l0, atol=1e-5, rtol=0)
    assert abs(v1 - v0) < 1e-5
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p0)):
        assert rel(a, b) < 2e-5

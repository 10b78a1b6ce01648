"""The fused host kernels against optax's own update of the same transformation.

Both run `HostOptimizer.update_unit` on one Llama block for several steps from the same state and
gradients, with clipping and averaging folded into the gradient factor; one with the fused kernels,
one with the optax transformation jitted on XLA:CPU. Tolerances are fixed:
- float32 moments: parameters and moments within 1e-6 relative per leaf (float32 rounding of
  differently ordered operations, a few ulp per step).
- bfloat16 moments: a float32 difference of one ulp can flip a bf16 rounding of a moment (2^-8
  relative), which moves that element's update by up to 2^-8 relative. Moments: within 1e-2
  relative. Parameters: each step changes them by about lr / |p| = 1e-3 / 0.02 = 5% here, so three
  steps can differ by up to 3 * 5% * 2^-8 = 6e-4 relative: within 1e-3 per leaf.
- Lion's update is sign(x): where x is within rounding of 0 the two programs (which contract
  multiply-adds differently) can take opposite signs, moving that element by 2 * lr. Parameters
  within 1e-4 relative per leaf (a few such elements per leaf).
"""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from subprocess_run import REPO, user_env

from jaxzero.config import TrainConfig
from jaxzero.models import build_model
from jaxzero.offload import host_kernels
from jaxzero.offload.host_optimizer import HostOptimizer, HostUnit, UnitUpdate
from jaxzero.overrides import apply_overrides
from jaxzero.plan import placement, resolve_plan

OPTIMIZERS = {
    "adamw": {"optimizer.name": "adamw", "optimizer.weight_decay": "0.1"},
    "adam": {"optimizer.name": "adam", "optimizer.weight_decay": "0"},
    "lion": {"optimizer.name": "lion", "optimizer.weight_decay": "0.1", "optimizer.lr": "1e-4"},
    "sgd-momentum": {"optimizer.name": "sgd", "optimizer.momentum": "0.9", "optimizer.weight_decay": "0.01"},
    "sgd": {"optimizer.name": "sgd", "optimizer.momentum": "0", "optimizer.weight_decay": "0.01"},
}


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def run(over: dict, fused: bool, grad_dtype, steps: int = 3, two_pass: bool = False, start: int = 0):
    """`steps` updates of one block from update number `start`; returns masters, state, weights."""
    accum = 1 if grad_dtype == jnp.bfloat16 else 2
    cfg = apply_overrides(
        TrainConfig(),
        {
            "model.name": "llama-tiny",
            "model.num_layers": "2",
            "optimizer.warmup_steps": "1",
            "offload.optimizer": "cpu",
            "offload.params": "cpu",
            "offload.fused_update": str(fused),
            "data.grad_accum": str(accum),
            **over,
        },
    )
    model = build_model(cfg.model)
    mesh = placement.make_mesh(jax.devices()[:1])
    plan = resolve_plan(cfg)
    where = placement.offload_placement(mesh, plan)
    shape = jax.eval_shape(model.init, jax.random.key(0))
    host = HostOptimizer(cfg.optimizer, 10, shape, where, accum)
    assert host.fused == fused
    block = plan.blocks[0]
    masters = jax.device_put(model.init(jax.random.key(0)), where.host)
    state = host.init(masters).blocks[0]
    if start:  # the step counts (optax's int32 scalars) as after `start` updates
        state = jax.tree.map(
            lambda x: jax.device_put(np.int32(start), x.sharding) if x.ndim == 0 else x, state
        )
    unit = HostUnit(masters.blocks[0], state, None)
    rng = np.random.default_rng(0)
    for k in range(steps):
        # One piece per leaf: the whole array (one device; see `UnitUpdate.grads`).
        g = jax.tree.map(
            lambda x: [(rng.standard_normal(x.shape) * 0.1).astype(grad_dtype)], masters.blocks[0]
        )
        # Clipping active on odd steps (norm 3 > max 1), the loss scale 2 and grad_accum folded in.
        gmul = host.grad_multiplier(np.float32(3.0 if k % 2 else 0.5), np.float32(2.0))
        if two_pass:  # the weights first, then masters and state, as the pipeline does
            u = UnitUpdate(block, unit, g, gmul)
            unit = host.commit(u, 1, host.update_weights(u, 0, recycle=unit.weights))
        else:
            unit = host.update_unit(UnitUpdate(block, unit, g, gmul), 0, recycle=unit.weights)
    return jax.device_get((unit.params, unit.opt_state, unit.weights))


@pytest.mark.parametrize("grad_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_fused_update_matches_optax(name, state_dtype, grad_dtype):
    over = {**OPTIMIZERS[name], "optimizer.state_dtype": state_dtype}
    fused, ref = run(over, True, grad_dtype), run(over, False, grad_dtype)
    p_tol, m_tol = (1e-6, 1e-6) if state_dtype == "float32" else (1e-3, 1e-2)
    if name == "lion":
        p_tol = max(p_tol, 1e-4)
    (pf, sf, wf), (pr, sr, wr) = fused, ref
    assert jax.tree.structure(sf) == jax.tree.structure(sr)
    for a, b in zip(jax.tree.leaves(pf), jax.tree.leaves(pr)):
        assert a.dtype == b.dtype and rel(a, b) < p_tol
    for a, b in zip(jax.tree.leaves(sf), jax.tree.leaves(sr)):
        assert a.dtype == b.dtype and a.shape == b.shape
        if a.ndim == 0:
            assert a == b  # step counts
        else:
            assert rel(a, b) < m_tol
    for a, b in zip(jax.tree.leaves(wf), jax.tree.leaves(wr)):  # compute-dtype weights
        assert a.dtype == b.dtype and rel(a, b) < max(p_tol, 2**-8)


@pytest.mark.parametrize("start", [163, 336])  # b1 = 0.9's correction is 1 from 164; b2 = 0.95's from 337
@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_fused_update_matches_optax_where_bias_corrections_are_one(state_dtype, start):
    """Across the update numbers where Adam's bias corrections become exactly 1 in float32 (where
    the kernels leave their divisions out), the fused update still matches optax's, which divides."""
    over = {**OPTIMIZERS["adamw"], "optimizer.state_dtype": state_dtype}
    (pf, sf, wf), (pr, sr, wr) = (run(over, f, jnp.bfloat16, start=start) for f in (True, False))
    p_tol, m_tol = (1e-6, 1e-6) if state_dtype == "float32" else (1e-3, 1e-2)
    for a, b in zip(jax.tree.leaves(pf), jax.tree.leaves(pr)):
        assert rel(a, b) < p_tol
    for a, b in zip(jax.tree.leaves(sf), jax.tree.leaves(sr)):
        assert (a == b) if a.ndim == 0 else rel(a, b) < m_tol
    for a, b in zip(jax.tree.leaves(wf), jax.tree.leaves(wr)):
        assert rel(a, b) < max(p_tol, 2**-8)


@pytest.mark.parametrize("pass_", list(host_kernels.Pass))
@pytest.mark.parametrize("moments", ["float32", "bfloat16"])
def test_a_division_by_an_exact_one_left_out_changes_no_bit(moments, pass_):
    """The kernels compiled without the bias corrections' divisions give the bits of the kernels that
    divide by 1.0, on every kind of float32 value (zeros of both signs, subnormals, huge, inf, NaN)."""
    n = 4 * 4096 + 7
    r = np.random.default_rng(3)
    special = np.array([0.0, -0.0, 1e-45, -1e-40, 3e-39, 1e38, -3e38, np.inf, -np.inf, np.nan], np.float32)

    def values(scale):
        x = (r.standard_normal(n) * scale).astype(np.float32)
        x[: special.size] = r.permutation(special)
        return x

    def bf16(x):
        return (x.view(np.uint32) >> 16).astype(np.uint16)

    p, m, v = values(1.0), values(1e-3), np.abs(values(1e-6))
    if moments == "bfloat16":
        m, v = bf16(m), bf16(v)
    g = bf16(values(1e-2))
    g.flags.writeable = False
    m16 = moments == "bfloat16"
    one = np.float32(1.0)
    scalars = (np.float32(0.7), np.float32(0.9), np.float32(0.95), np.float32(1e-8), one, one)
    results = []
    for unit in (frozenset(), frozenset({"bc1"}), frozenset({"bc1", "bc2"})):
        arrays = [p.copy(), m.copy(), v.copy()]
        arrays.append(g)
        if pass_ is not host_kernels.Pass.STATE:
            arrays.append(np.zeros(n, np.uint16))
        kernel = host_kernels._kernel("adam", True, m16, True, pass_, unit)
        kernel(*arrays, host_kernels._scratch(), *scalars, np.float32(-1e-3), np.float32(0.1))
        results.append(arrays)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    if pass_ is host_kernels.Pass.WEIGHTS:  # it did update: new weights, or new masters
        assert results[0][-1].any()
    else:
        written = results[0][0]
        assert not np.array_equal(written.view(np.uint32), p.view(np.uint32))


@pytest.mark.parametrize("pass_", list(host_kernels.Pass))
@pytest.mark.parametrize("moments", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["adam", "lion", "sgd_momentum"])
def test_prefetching_the_next_tile_changes_no_bit(monkeypatch, name, moments, pass_):
    """A kernel that updates in blocks and requests the next tile's lines after each (the layouts'
    prefetch) gives the bits of one that does not, on a length that ends mid-tile and mid-block, and
    with the next tile shorter than a block."""
    m16 = moments == "bfloat16"
    n = 3 * 1024 + 100  # tiles of 1024: three whole, then 100 (a block of 64 and 36)
    r = np.random.default_rng(4)

    def bits(x):
        return (x.view(np.uint32) >> 16).astype(np.uint16)

    p = r.standard_normal(n).astype(np.float32)
    moment = [
        (r.standard_normal(n) * 1e-3).astype(np.float32),
        np.abs(r.standard_normal(n) * 1e-6).astype(np.float32),
    ]
    moment = [bits(x) if m16 else x for x in moment][: {"adam": 2, "lion": 1, "sgd_momentum": 1}[name]]
    g = bits((r.standard_normal(n) * 1e-2).astype(np.float32))
    g.flags.writeable = False
    scalars = {
        "adam": (np.float32(0.9), np.float32(0.95), np.float32(1e-8), np.float32(0.5), np.float32(0.7)),
        "lion": (np.float32(0.9), np.float32(0.99)),
        "sgd_momentum": (np.float32(0.9),),
    }[name]
    results = []
    for fetch in (0, 64):
        monkeypatch.setattr(host_kernels, "LAYOUTS", {**host_kernels.LAYOUTS, m16: (1024, fetch)})
        arrays = [p.copy(), *(x.copy() for x in moment)]
        arrays.append(g)
        if pass_ is not host_kernels.Pass.STATE:
            arrays.append(np.zeros(n, np.uint16))
        kernel = host_kernels._kernel(name, True, m16, True, pass_)
        kernel(
            *arrays, host_kernels._scratch(), np.float32(0.3), *scalars, np.float32(-1e-3), np.float32(0.1)
        )
        results.append(arrays)
    for a, b in zip(*results):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    if pass_ is host_kernels.Pass.WEIGHTS:  # it did update: new weights, or new masters
        assert results[0][-1].any()
    else:
        written = results[0][0]
        assert not np.array_equal(written, p)


def test_the_rate_is_the_schedules_float32_value_computed_once_per_update_number():
    """Every unit of a step shares its update number's rate: the host computes it once (before the
    norm is known, `HostOptimizer.prepare`), the jitted schedule's float32 value on the host device."""
    cfg = apply_overrides(
        TrainConfig(),
        {"model.name": "llama-tiny", "model.num_layers": "1", "optimizer.warmup_steps": "3"}
        | {"offload.optimizer": "cpu", "offload.params": "cpu"},
    )
    model = build_model(cfg.model)
    where = placement.offload_placement(placement.make_mesh(jax.devices()[:1]), resolve_plan(cfg))
    host = HostOptimizer(cfg.optimizer, 10, jax.eval_shape(model.init, jax.random.key(0)), where, 1)
    calls = []
    schedule = host._lr
    host._lr = lambda step: calls.append(int(step)) or schedule(step)
    rates = [host.rate(k) for k in (0, 1, 1, 2, 2, 2, 5)]
    assert calls == [0, 1, 2, 5]
    expected = [float(schedule(jax.device_put(np.int32(k), where.host))) for k in (0, 1, 1, 2, 2, 2, 5)]
    assert rates == expected and len(set(rates)) == 4


@pytest.mark.parametrize("grad_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_two_pass_update_is_bitwise_the_one_pass_update(name, state_dtype, grad_dtype):
    """The weights pass then the state pass give exactly the bits of the one-pass kernel: masters,
    moments, step counts and compute-dtype weights (the new weights written into the old ones'
    pinned buffers, as the pipeline recycles them)."""
    over = {**OPTIMIZERS[name], "optimizer.state_dtype": state_dtype}
    one, two = run(over, True, grad_dtype), run(over, True, grad_dtype, two_pass=True)
    assert jax.tree.structure(one) == jax.tree.structure(two)
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(two)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.atleast_1d(a).view(np.uint8), np.atleast_1d(b).view(np.uint8))


def test_bfloat16_rounding_is_round_to_nearest_even():
    x = np.array([1.0, 1.00390625, 1.01171875, 1.0078125, -2.5e-3, 3.4e38, np.nan, 0.0, -0.0], np.float32)
    x = np.concatenate([x, np.random.default_rng(0).standard_normal(4096).astype(np.float32)])
    p, w = x.copy(), np.zeros(x.size, np.uint16)
    # SGD with lr 0 and no decay writes the parameter through to the compute-dtype copy unchanged
    # (ties 1.00390625 and 1.01171875 round to even; 3.4e38 overflows to inf, as XLA's convert does).
    host_kernels.FusedRule(name="sgd", b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0).kernel(
        0, 0.0, 1.0
    )(p, np.zeros_like(x), w, 0.0)
    expected = np.asarray(jnp.asarray(x).astype(jnp.bfloat16)).view(np.uint16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(w[~nan], expected[~nan])
    assert np.isnan(w[nan].view(jnp.bfloat16).astype(np.float32)).all()


@pytest.mark.parametrize("moments", ["float32", "bfloat16"])
def test_chunks_and_tiles_do_not_change_the_result(moments):
    """A long array updated in one call (several internal tiles, a ragged last one) equals the same
    array updated in small pieces: the kernels are elementwise, so tiling must be invisible."""
    n = 2 * host_kernels.LAYOUTS[moments == "bfloat16"][0] + 12345
    rng = np.random.default_rng(1)
    mdt = np.uint16 if moments == "bfloat16" else np.float32

    def state():
        r = np.random.default_rng(2)
        p = r.standard_normal(n).astype(np.float32)
        m = (r.standard_normal(n).astype(np.float32) * 0.1).view(np.uint32)
        m = (m >> 16).astype(np.uint16) if moments == "bfloat16" else m.view(np.float32)
        v = np.abs(r.standard_normal(n).astype(np.float32))
        v = (v.view(np.uint32) >> 16).astype(np.uint16) if moments == "bfloat16" else v
        return p, m.astype(mdt), v.astype(mdt)

    g = (rng.standard_normal(n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    rule = host_kernels.FusedRule(name="adamw", b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, momentum=0.0)
    kernel = rule.kernel(4, 3e-4, 0.7)
    (p1, m1, v1), (p2, m2, v2) = state(), state()
    w1, w2 = np.zeros(n, np.uint16), np.zeros(n, np.uint16)
    kernel(p1, m1, v1, g, w1, 0.1)
    for s in host_kernels.chunks(n, 1000):
        kernel(p2[s], m2[s], v2[s], g[s], w2[s], 0.1)
    for a, b in ((p1, p2), (m1, m2), (v1, v2), (w1, w2)):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(p1, state()[0])  # it did update


@pytest.mark.slow  # a fresh process: numba's dispatchers are process-wide
def test_warm_up_compiles_what_the_update_runs():
    """The kernels compiled while the model initialises are exactly those the updates call, for the
    embedding, blocks and head (float32 and bf16 gradients), one pass and two: the same kernels and
    numba signatures (read-only gradient views included), so no compilation inside a training step.
    In a fresh process: numba's dispatchers and their signatures are process-wide."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "programs" / "warm_up_kernels.py")],
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "OK", proc.stdout[-3000:]

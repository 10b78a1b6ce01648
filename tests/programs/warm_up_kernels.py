"""Run by tests/test_host_kernels.py in a fresh process (numba's dispatchers are process-wide): build a
host optimizer, let its warm-up finish, then update the embedding, a block and the head in one pass
and in two, as the pipeline does, with gradients as the engine delivers them (NumPy views of
pinned_host; bf16 for blocks with one micro-batch, float32 for the embedding and head), at update
numbers before and after Adam's bias corrections round to 1 (each its own kernel). Prints "OK" if no
kernel and no kernel signature was added after the warm-up, else what was."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np

from jaxzero.config import TrainConfig
from jaxzero.models import build_model
from jaxzero.offload import host_kernels
from jaxzero.offload.host_memory import local_views
from jaxzero.offload.host_optimizer import HostOptimizer, HostUnit, UnitUpdate
from jaxzero.overrides import apply_overrides
from jaxzero.plan import placement, resolve_plan

over = {
    "model.name": "llama-tiny",
    "model.num_layers": "1",
    "offload.optimizer": "cpu",
    "offload.params": "cpu",
}
cfg = apply_overrides(TrainConfig(), over)
model = build_model(cfg.model)
plan = resolve_plan(cfg)
where = placement.offload_placement(placement.make_mesh(jax.devices()[:1]), plan)
STEPS = 400  # b1 = 0.9's correction is 1 from update 164, b2 = 0.95's from 337
# A schedule of 10 steps in a run of STEPS updates (a resume that extended `steps` keeps its schedule).
shapes = jax.eval_shape(model.init, jax.random.key(0))
host = HostOptimizer(cfg.optimizer, 10, shapes, where, 1, updates=STEPS)
for f in host.warmed_up:
    f.result()
compiled = {k: list(d.signatures) for k, d in host_kernels._kernels.items()}
masters = jax.device_put(model.init(jax.random.key(0)), where.host)
state = host.init(masters)


def at_count(opt_state, count):
    """`opt_state` with its step counts at `count` (optax's int32 scalars)."""
    scalar = lambda x: jax.device_put(np.int32(count), x.sharding) if x.ndim == 0 else x  # noqa: E731
    return jax.tree.map(scalar, opt_state)


for count, (unit_plan, params, opt, dtype) in itertools.product(
    (0, 200, STEPS - 1),
    (
        (plan.units[0], masters.embed, state.embed, jnp.float32),
        (plan.blocks[0], masters.blocks[0], state.blocks[0], jnp.bfloat16),
        (plan.units[-1], masters.head, state.head, jnp.float32),
    ),
):
    g = jax.device_put(jax.tree.map(lambda x, d=dtype: np.full(x.shape, 1e-3, d), params), where.pinned)
    g = jax.tree.map(local_views, g)
    opt = at_count(opt, count)
    unit = host.update_unit(UnitUpdate(unit_plan, HostUnit(params, opt, None), g, np.float32(1.0)), 0)
    u = UnitUpdate(unit_plan, unit, g, np.float32(1.0))
    host.commit(u, 1, host.update_weights(u, 0, recycle=unit.weights))
after = {k: list(d.signatures) for k, d in host_kernels._kernels.items()}
new = {k: v for k, v in after.items() if compiled.get(k) != v}
assert {k[-1] for k in after} == {frozenset(), frozenset({"bc1"}), frozenset({"bc1", "bc2"})}, after.keys()
print("OK" if compiled and not new else f"compiled after the warm-up: {new}")

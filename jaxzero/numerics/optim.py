"""The optimizer: an Optax transformation built from `OptimizerConfig`.

The same transformation runs on the accelerator (resident training) and on the host (offloaded
optimizer): placement is decided elsewhere, this module only says *what* the update is. A researcher's
own transformation (`build_trainer(..., optimizer=tx)`) takes the named optimizer's place (`custom`):
jaxzero still clips by the global norm (`optimizer.grad_clip`) before it, and the offload engine
applies it to each unit's parameters separately, so it must be per-parameter (elementwise, as optax's
adam, adamw, lion and sgd are, schedules included).

    tx = build_optimizer(cfg.optimizer, total_steps=cfg.schedule_steps)
    lr = learning_rate_schedule(cfg.optimizer, total_steps)(step)
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxzero.config import ConfigError, OptimizerConfig
from jaxzero.models import ModelParams


def learning_rate_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """Warmup from `lr * warmup_start_ratio` to `lr` over `warmup_steps` (linear in the step, or
    DeepSpeed's log(step + 1) / log(warmup_steps)), then cosine/linear decay to `lr*min_lr_ratio` at
    `total_steps` (or constant). Maps an int32 step count (0-based, the number of updates already
    applied) to a float32 learning rate."""
    end = cfg.lr * cfg.min_lr_ratio
    warmup = max(cfg.warmup_steps, 0)
    decay_steps = max(total_steps - warmup, 1)
    if cfg.schedule == "constant":
        after = optax.constant_schedule(cfg.lr)
    elif cfg.schedule == "cosine":
        after = optax.cosine_decay_schedule(cfg.lr, decay_steps, alpha=cfg.min_lr_ratio)
    else:
        after = optax.linear_schedule(cfg.lr, end, decay_steps)
    if warmup == 0:
        return after
    start = cfg.lr * cfg.warmup_start_ratio
    if cfg.warmup_type == "linear":
        ramp = optax.linear_schedule(start, cfg.lr, warmup)
    else:  # DeepSpeed's log warmup, over at least 2 steps as there
        inv_log = 1.0 / math.log(max(warmup, 2))
        ramp = lambda count: start + (cfg.lr - start) * inv_log * jnp.log1p(count.astype(jnp.float32))  # noqa: E731
    return optax.join_schedules([ramp, after], [warmup])


def reported_rate(
    cfg: OptimizerConfig, total_steps: int, custom: optax.GradientTransformation | None = None
) -> optax.Schedule:
    """The learning rate a step's metrics report: `learning_rate_schedule`'s, or float32 NaN for a
    researcher's own transformation, whose rate (if it has one) jaxzero cannot read."""
    if custom is None:
        return learning_rate_schedule(cfg, total_steps)
    return lambda count: jnp.full((), jnp.nan, jnp.float32)


def warmup_warning(cfg: OptimizerConfig, steps: int, schedule_steps: int) -> str | None:
    """A warning with the numbers when a run of `steps` steps ends before its warmup does (its peak
    learning rate never applies), else None. `schedule_steps` is the schedule's length."""
    if cfg.warmup_steps < steps:
        return None
    last = float(learning_rate_schedule(cfg, schedule_steps)(jnp.asarray(steps - 1)))  # last update's count
    return (
        f"optimizer.warmup_steps={cfg.warmup_steps} >= steps={steps}: the learning rate never reaches "
        f"optimizer.lr={cfg.lr:g}; the last step's is {last:.3g} ({last / cfg.lr:.0%} of it). Lower "
        f"optimizer.warmup_steps (e.g. --optimizer.warmup_steps={steps // 10}) or raise steps."
    )


def weight_decay_mask(params: ModelParams, decay_all: bool = False) -> ModelParams:
    """True where weight decay applies: matrices (ndim >= 2) in blocks and head; embeddings, norm
    scales and biases are excluded. With `decay_all` every leaf decays. Works on arrays or
    `jax.ShapeDtypeStruct`s (only `.shape` is read)."""
    if decay_all:
        return jax.tree.map(lambda _: True, params)
    is_matrix = lambda x: len(x.shape) >= 2  # noqa: E731
    return ModelParams(
        embed=jax.tree.map(lambda _: False, params.embed),
        blocks=jax.tree.map(is_matrix, params.blocks),
        head=jax.tree.map(is_matrix, params.head),
    )


def build_optimizer(
    cfg: OptimizerConfig,
    total_steps: int,
    *,
    clip: bool = True,
    mask: Any = None,
    custom: optax.GradientTransformation | None = None,
) -> optax.GradientTransformation:
    """Global-norm clipping (if `clip` and `grad_clip > 0`) followed by the named optimizer, or by
    `custom` (a researcher's own transformation: then only `cfg.grad_clip` is read).

    The transformation expects float32 gradients and float32 master params. By default they are whole
    `ModelParams` and the weight-decay mask is `weight_decay_mask`; pass `mask` (a pytree of bools
    matching the params) to apply it to one unit of a model, e.g. a single block. Clipping needs the
    whole gradient, so per-unit users pass `clip=False` and clip with `clip_by_norm`.
    """
    if custom is not None:  # clipped as the named ones are, so the state's layout is theirs
        clipping = clip and cfg.grad_clip > 0
        return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), custom) if clipping else custom
    lr = learning_rate_schedule(cfg, total_steps)
    if mask is None:
        mask = lambda p: weight_decay_mask(p, cfg.decay_norms_biases_embeddings)  # noqa: E731
    low = cfg.state_dtype != "float32"  # moments stored narrow; each update still computed in float32
    state_dtype = jnp.dtype(cfg.state_dtype)
    if cfg.name in ("adamw", "adam"):
        if cfg.name == "adam" and cfg.weight_decay:
            raise ConfigError(
                f"optimizer.name=adam has no weight decay but optimizer.weight_decay={cfg.weight_decay}; "
                "use optimizer.name=adamw for decoupled decay, or set optimizer.weight_decay=0."
            )
        if not low and cfg.name == "adamw":  # optax's own, exactly
            opt = optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=mask)
        elif not low:
            opt = optax.adam(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)
        else:  # optax.adamw's chain with both moments stored in `state_dtype`
            parts = [scale_by_adam_stored_as(state_dtype, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)]
            if cfg.name == "adamw":
                parts.append(optax.add_decayed_weights(cfg.weight_decay, mask))
            opt = optax.chain(*parts, optax.scale_by_learning_rate(lr))
    elif cfg.name == "lion":
        mu_dtype = state_dtype if low else None
        opt = optax.lion(
            lr, b1=cfg.b1, b2=cfg.b2, mu_dtype=mu_dtype, weight_decay=cfg.weight_decay, mask=mask
        )
    elif cfg.name == "sgd":
        opt = optax.chain(
            optax.add_decayed_weights(cfg.weight_decay, mask=mask),
            optax.sgd(lr, momentum=cfg.momentum or None, accumulator_dtype=state_dtype if low else None),
        )
    else:  # config validation makes this unreachable; keep the message for library callers
        raise ConfigError(f"optimizer.name={cfg.name!r} is not one of adamw, adam, lion, sgd.")
    if clip and cfg.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), opt)
    return opt


def unit_optimizers(
    cfg: OptimizerConfig,
    total_steps: int,
    masters_shape: ModelParams,
    custom: optax.GradientTransformation | None = None,
) -> ModelParams:
    """The transformation of each kind of unit, for updating one unit at a time: `ModelParams(embed,
    blocks, head)` with one transformation for every block, each with its unit's weight-decay mask
    and without clipping (the caller scales by the global norm: `scaled_update`). With `custom`, that
    transformation for every unit, applied to each unit's parameters alone."""
    if custom is not None:
        return ModelParams(embed=custom, blocks=custom, head=custom)
    mask = weight_decay_mask(masters_shape, cfg.decay_norms_biases_embeddings)
    return ModelParams(
        embed=build_optimizer(cfg, total_steps, clip=False, mask=mask.embed),
        blocks=build_optimizer(cfg, total_steps, clip=False, mask=mask.blocks[0]),  # blocks share one
        head=build_optimizer(cfg, total_steps, clip=False, mask=mask.head),
    )


def scaled_update(
    tx: optax.GradientTransformation, masters: Any, opt_state: Any, grads: Any, gmul: jax.Array
) -> tuple[Any, Any]:
    """One unit's step of `tx` (from `unit_optimizers`): its gradient sums, upcast to float32, times
    `gmul` (averaging, loss scale and clipping in one factor), applied to its float32 masters.
    Returns the new masters and optimizer state."""
    g = jax.tree.map(lambda x: x.astype(jnp.float32) * gmul, grads)
    updates, opt_state = tx.update(g, opt_state, masters)
    return optax.apply_updates(masters, updates), opt_state


def scale_by_adam_stored_as(
    dtype: jnp.dtype, *, b1: float, b2: float, eps: float
) -> optax.GradientTransformation:
    """`optax.scale_by_adam` whose first and second moments are *stored* in `dtype` (e.g. bfloat16).

    Each update computes the new moments and the step in float32 from the stored values (optax
    promotes `b * m + (1 - b) * g` to float32) and only the stored moments are rounded, so the state
    costs 2 + 2 bytes per parameter instead of 4 + 4. The price: every step rounds both moments to
    bf16's 8-bit mantissa (relative error <= 2^-9), which perturbs each update by a few 1e-3 relative.
    """
    inner = optax.scale_by_adam(b1=b1, b2=b2, eps=eps, mu_dtype=dtype)

    def init(params):
        state = inner.init(params)
        return state._replace(nu=optax.tree.cast(state.nu, dtype))  # optax keeps nu in its own dtype

    return optax.GradientTransformation(init, inner.update)


def clip_by_norm(tree: Any, norm: jax.Array, max_norm: float) -> Any:
    """`optax.clip_by_global_norm`'s rule with the global norm given: leaves scaled by max_norm/norm
    when norm >= max_norm. Lets a gradient be clipped one unit at a time once the norm is known."""
    trigger = norm < max_norm
    return jax.tree.map(lambda t: jax.lax.select(trigger, t, (t / norm.astype(t.dtype)) * max_norm), tree)


def global_norm(tree: Any) -> jax.Array:
    """L2 norm over all leaves, accumulated in float32. Scalar float32."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


# ---------------------------------------------------------------------------------------------------
# Optimizer-state layouts. The resident trainer keeps one optax state over the whole `ModelParams`;
# the offload engine keeps one per unit (embedding, each block, head), without the clipping state.
# Checkpoints always hold the per-unit form, so a run can resume under either trainer.
# ---------------------------------------------------------------------------------------------------


def _is_params(x: Any) -> bool:
    return isinstance(x, ModelParams)


def split_opt_state(state: Any, clipped: bool, num_blocks: int | None = None) -> ModelParams:
    """Whole-model optax state (of `build_optimizer(..., clip=clipped)`) -> per-unit states in
    `ModelParams` layout. Param-shaped parts are sliced per unit; scalars (step counts) are shared.
    Works on arrays and on ShapeDtypeStructs. `num_blocks`: the model's blocks, needed only for a
    state holding nothing param-shaped (e.g. SGD without momentum: every unit shares it whole)."""
    inner = state[1] if clipped else state  # chain(clip_by_global_norm, opt): (EmptyState, opt state)

    def unit(select):
        return jax.tree.map(lambda x: select(x) if _is_params(x) else x, inner, is_leaf=_is_params)

    shaped = [x for x in jax.tree.leaves(inner, is_leaf=_is_params) if _is_params(x)]
    if not shaped and num_blocks is None:
        raise ValueError("an optimizer state holding nothing param-shaped needs num_blocks to be split")
    blocks = len(shaped[0].blocks) if shaped else num_blocks
    return ModelParams(
        embed=unit(lambda p: p.embed),
        blocks=tuple(unit(lambda p, i=i: p.blocks[i]) for i in range(blocks)),
        head=unit(lambda p: p.head),
    )


def join_opt_state(units: ModelParams, template: Any, clipped: bool) -> Any:
    """Per-unit states -> the whole-model optax state shaped like `template` (e.g. `jax.eval_shape`
    of `build_optimizer(..., clip=clipped).init`). Inverse of `split_opt_state`."""
    inner_template = template[1] if clipped else template
    paths_and_nodes, treedef = jax.tree_util.tree_flatten_with_path(inner_template, is_leaf=_is_params)

    def at(tree: Any, path) -> Any:
        for key in path:
            if isinstance(key, jax.tree_util.GetAttrKey):
                tree = getattr(tree, key.name)
            elif isinstance(key, jax.tree_util.SequenceKey):
                tree = tree[key.idx]
            else:
                tree = tree[key.key]
        return tree

    leaves = []
    for path, node in paths_and_nodes:
        if _is_params(node):
            leaves.append(
                ModelParams(
                    at(units.embed, path), tuple(at(b, path) for b in units.blocks), at(units.head, path)
                )
            )
        else:
            leaves.append(at(units.embed, path))  # a shared scalar, e.g. the step count
    inner = jax.tree_util.tree_unflatten(treedef, leaves)
    return (template[0], inner) if clipped else inner

"""The experts' grouped matmul on Hopper GPUs, and which grouping a step uses.

A mixture of experts' dropless grouping multiplies each expert's consecutive sorted rows by its own
kernel (`moe.experts_ragged_dot`'s `matmul`). Outside TPUs `jax.lax.ragged_dot` lowers to every row
against every expert, so the library's portable grouping pads each expert's rows into blocks
(`moe.experts_padded`); on Hopper, JAX's Pallas Mosaic GPU kernels compute the grouped product
itself, reading each kernel in place (no per-block copy, no padded rows): 1.6x (Qwen3-30B-A3B) and
2.5x (Mixtral) the padded grouping's layer on an H100, with 4-14x less memory (BENCHMARKS.md,
"Issue 45 on one H100").

    impl = experts_impl(cfg.model.moe_impl, jnp.bfloat16)  # "mosaic" on one Hopper GPU
    matmul = mosaic_matmul()        # rows (N, I), kernels (E, I, O), group_sizes (E,) -> (N, O)

`model.moe_impl` names the grouping: "padded", "mosaic", or "auto" (the Mosaic kernels where
`mosaic_unsupported` finds no reason against them, else padded). Biased experts (gpt-oss's) take the
kernels too, each bias one more row of its kernel (`moe._grouped`). The run's resolution pass decides
"auto" once for the machine it plans for (`planned_impl`); a model given "auto" (library use without
a plan) decides by its own backend when its step is traced.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxzero.config import ConfigError
from jaxzero.models import layers

GroupedMatmul = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]

# The tiles the Mosaic kernels ran with at Qwen3-MoE's layer shape (scripts/bench_moe.py). The
# kernels' gradient tiles both of its dimensions by 128 and the forward tiles its contraction by 64,
# so a hidden size or expert width that is no multiple of 128 reaches them padded (`dims_padded`).
MOSAIC_TILES = {"block_m": 128, "block_n": 128, "block_k": 64, "max_concurrent_steps": 4, "grid_block_n": 1}
MOSAIC_ALIGN = 128
IMPLS = ("auto", "padded", "mosaic")
# Device kinds of the planner's machine that are Hopper GPUs (`planner.machine.Machine.kind`).
HOPPER_KINDS = ("H100", "H200")
# A Pallas kernel is not partitioned by XLA's SPMD partitioner: over a mesh its operands would be
# gathered to every device. Runs over several devices group their experts by the padded blocks.
SHARDED = "over a mesh XLA would gather its operands to every device; use model.moe_impl=padded"


def with_vjp(
    forward: GroupedMatmul,
    rows_grad: GroupedMatmul,
    kernels_grad: Callable[[jax.Array, jax.Array, jax.Array], jax.Array],
) -> GroupedMatmul:
    """A differentiable grouped matmul from three kernels, each over rows sorted by group:
      forward(rows (N, I), kernels (E, I, O), group_sizes (E,)) -> (N, O): rows_g @ kernels[g]
      rows_grad(dy (N, O), kernels (E, I, O), group_sizes) -> (N, I): dy_g @ kernels[g].T
      kernels_grad(rows (N, I), dy (N, O), group_sizes) -> (E, I, O): rows_g.T @ dy_g
    group_sizes int32, summing to N; integer, so it has no gradient. Jitted, each kernel too: the
    layers of a model that calls it at one shape share one lowering (a Pallas kernel is traced and
    lowered again at every call site that is not a call of the same jitted function)."""
    forward, rows_grad, kernels_grad = jax.jit(forward), jax.jit(rows_grad), jax.jit(kernels_grad)

    @jax.custom_vjp
    def matmul(rows: jax.Array, kernels: jax.Array, group_sizes: jax.Array) -> jax.Array:
        return forward(rows, kernels, group_sizes)

    def fwd(rows: jax.Array, kernels: jax.Array, group_sizes: jax.Array) -> tuple[jax.Array, tuple]:
        return forward(rows, kernels, group_sizes), (rows, kernels, group_sizes)

    def bwd(res: tuple, dy: jax.Array) -> tuple[jax.Array, jax.Array, None]:
        rows, kernels, group_sizes = res
        dy = dy.astype(rows.dtype)
        return rows_grad(dy, kernels, group_sizes), kernels_grad(rows, dy, group_sizes), None

    matmul.defvjp(fwd, bwd)
    return jax.jit(matmul)


def rows_padded(matmul: GroupedMatmul, multiple: int) -> GroupedMatmul:
    """`matmul` over its rows padded with zero rows to a multiple of `multiple`, counted in the last
    group, and its product cut back to the rows given. The Mosaic kernels tile the rows and refuse a
    count that is no multiple of their tile (a prompt's 9 tokens x top-2 = 18 rows while decoding).
    Exact: each row's product is its own, and zero rows add nothing to the kernels' gradient."""

    @jax.jit
    def padded(rows: jax.Array, kernels: jax.Array, group_sizes: jax.Array) -> jax.Array:
        n = rows.shape[0]
        pad = -n % multiple
        if pad == 0:
            return matmul(rows, kernels, group_sizes)
        rows = jnp.pad(rows, ((0, pad), (0, 0)))
        return matmul(rows, kernels, group_sizes.at[-1].add(pad))[:n]

    return padded


def dims_padded(matmul: GroupedMatmul, multiple: int) -> GroupedMatmul:
    """`matmul` over kernels (E, I, O) whose I and O are padded with zeros to multiples of
    `multiple` (and the rows' I likewise), its product cut back to (N, O). The Mosaic kernels tile
    both widths by 128 and gpt-oss's are 2,880 (BENCHMARKS.md, "gpt-oss's experts on the Mosaic
    grouping"). Exact: a padded column of the rows meets a padded row of the kernels, so each
    product and gradient sums the same terms plus zeros (the kernels add whole tiles of zeros after
    the others); the gradients of the padding are cut off.
    Costs a padded copy of the kernels per call (and of their gradient in the backward pass)."""

    @jax.jit
    def padded(rows: jax.Array, kernels: jax.Array, group_sizes: jax.Array) -> jax.Array:
        i, o = kernels.shape[1:]
        pad_i, pad_o = -i % multiple, -o % multiple
        if pad_i == 0 and pad_o == 0:
            return matmul(rows, kernels, group_sizes)
        rows = jnp.pad(rows, ((0, 0), (0, pad_i)))
        kernels = jnp.pad(kernels, ((0, 0), (0, pad_i), (0, pad_o)))
        return matmul(rows, kernels, group_sizes)[:, :o]

    return padded


@functools.cache
def mosaic_matmul() -> GroupedMatmul:
    """The grouped matmul of JAX's Pallas Mosaic GPU kernels (Hopper only; bf16 or f16 rows and
    kernels of one dtype, every float32 accumulation inside the kernel): `ragged_dot_mgpu` for the
    product and the rows' gradient, `transposed_ragged_dot_mgpu` for the kernels'. One function per
    process (`with_vjp`'s lowering is shared by its every call at one shape), over rows padded to
    the kernels' row tile (`rows_padded`) and widths padded to their column tile (`dims_padded`).
    Raises ImportError where this JAX lacks them."""
    # Here, not at the top: the Mosaic GPU modules are Hopper's alone and may be absent from a JAX.
    from jax.experimental.pallas.ops.gpu.ragged_dot_mgpu import ragged_dot
    from jax.experimental.pallas.ops.gpu.transposed_ragged_dot_mgpu import transposed_ragged_dot  # likewise

    def forward(rows: jax.Array, kernels: jax.Array, group_sizes: jax.Array) -> jax.Array:
        return ragged_dot(rows, kernels, group_sizes=group_sizes, **MOSAIC_TILES)

    def rows_grad(dy: jax.Array, kernels: jax.Array, group_sizes: jax.Array) -> jax.Array:
        return ragged_dot(dy, kernels, group_sizes=group_sizes, transpose_rhs=True, **MOSAIC_TILES)

    def kernels_grad(rows: jax.Array, dy: jax.Array, group_sizes: jax.Array) -> jax.Array:
        return transposed_ragged_dot(rows, dy, group_sizes=group_sizes, **MOSAIC_TILES)

    return tiled_matmul(forward, rows_grad, kernels_grad, rows=MOSAIC_TILES["block_m"], widths=MOSAIC_ALIGN)


def tiled_matmul(
    forward: GroupedMatmul,
    rows_grad: GroupedMatmul,
    kernels_grad: Callable[[jax.Array, jax.Array, jax.Array], jax.Array],
    *,
    rows: int,
    widths: int,
) -> GroupedMatmul:
    """The differentiable grouped matmul (`with_vjp`) of three kernels that take whole tiles only:
    rows padded to a multiple of `rows` (`rows_padded`), both widths of the kernels to a multiple
    of `widths` (`dims_padded`). `mosaic_matmul` is this over the Mosaic GPU kernels."""
    return rows_padded(dims_padded(with_vjp(forward, rows_grad, kernels_grad), widths), rows)


def _dtype_reason(dtype: jnp.dtype) -> str | None:
    """Why the Mosaic kernels cannot take this layer on any GPU, or None (any widths: `dims_padded`)."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"they multiply bfloat16 or float16, and model.compute_dtype is {jnp.dtype(dtype).name}"
    return None


def mosaic_unsupported(dtype: jnp.dtype) -> str | None:
    """Why the Mosaic kernels cannot run this layer on this process's default backend, or None."""
    is_cuda, cc = layers.cuda_backend()
    if not is_cuda:
        return f"they run on CUDA GPUs, and the default JAX backend is {jax.default_backend()!r}"
    if cc is None or cc[0] != 9:
        return f"they are written for Hopper GPUs (compute capability 9.x), and this GPU's is {cc}"
    if jax.device_count() > 1:
        return f"they are a kernel of one device, and the run spans {jax.device_count()} ({SHARDED})"
    reason = _dtype_reason(dtype)
    if reason is None:
        try:
            mosaic_matmul()
        except ImportError as exc:
            reason = f"this JAX lacks them ({type(exc).__name__}: {exc})"
    return reason


def planned_reason(device_kind: str, devices: int, dtype: jnp.dtype) -> str | None:
    """Why the Mosaic kernels cannot run this layer on a machine of `devices` devices of kind
    `device_kind` (the planner's `Machine.kind`), or None: they run on one Hopper GPU, for shapes
    and dtypes that suit them."""
    if device_kind not in HOPPER_KINDS:
        hopper = ", ".join(HOPPER_KINDS)
        return f"they are written for Hopper GPUs ({hopper}), and the machine's is {device_kind}"
    if devices > 1:
        return f"they are a kernel of one device, and the run spans {devices} ({SHARDED})"
    return _dtype_reason(dtype)


def planned_impl(requested: str, device_kind: str, devices: int, dtype: jnp.dtype) -> str:
    """The grouping `model.moe_impl=requested` ("auto" or "mosaic") runs as on a machine of `devices`
    devices of kind `device_kind`, by `planned_reason` (`_decided`)."""
    return _decided(requested, planned_reason(device_kind, devices, dtype))


def experts_impl(requested: str, dtype: jnp.dtype) -> str:
    """`model.moe_impl` as this process's backend runs it, when the step is traced: "padded" as
    asked; "auto" or "mosaic" by `mosaic_unsupported` (`_decided`)."""
    if requested == "padded":
        return "padded"
    if requested not in IMPLS:
        raise ConfigError(f"model.moe_impl={requested!r} is not one of {list(IMPLS)}.")
    return _decided(requested, mosaic_unsupported(dtype))


def _decided(requested: str, reason: str | None) -> str:
    """What "auto" or "mosaic" becomes, where `reason` says why the Mosaic kernels cannot run (None:
    nothing does): "mosaic" where nothing does; else "padded" for "auto", and for "mosaic" a
    ConfigError with the reason."""
    if reason is None:
        return "mosaic"
    if requested == "mosaic":
        raise ConfigError(
            f"model.moe_impl=mosaic cannot be used: {reason}. Use model.moe_impl=auto or padded."
        )
    return "padded"

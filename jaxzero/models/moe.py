"""A mixture-of-experts layer: routing, dropless grouped experts and the load-balancing loss.

Pure functions of arrays for the three families transformers ships as `MixtralSparseMoeBlock`,
`Qwen3MoeSparseMoeBlock` and gpt-oss's `GptOssMLP`; nothing here knows of devices or memory kinds.

    spec = qwen3_moe_spec(num_experts=64, top_k=8, norm_topk_prob=True)
    params = init_moe(key, spec, hidden=2048, intermediate=768)
    y, routing = moe_block(params, x, spec)          # x (T, D) -> y (T, D), routing.logits (T, E)
    stats = router_stats(routing)                     # per layer: RouterStats of (E,), (E,), ()

Parameters (float32 masters, cast to the compute dtype by the caller or by `moe_block`):

    router   {"kernel": (D, E), "bias": (E,) gpt-oss only}
    gate_up  {"kernel": (E, D, 2F), "bias": (E, 2F) gpt-oss only}   last axis [gate | up], concatenated
    down     {"kernel": (E, F, D), "bias": (E, D) gpt-oss only}

HF stores Mixtral/Qwen3-MoE `gate_up_proj` as (E, 2F, D) ([gate; up] rows) and `down_proj` as (E, D, F):
transpose the last two axes. gpt-oss stores `gate_up_proj` as (E, D, 2F) with gate and up INTERLEAVED
on the last axis (gate = [..., ::2], up = [..., 1::2]) and `down_proj` as (E, F, D): de-interleave.

Routing (exactly transformers' arithmetic; logits are computed with float32 accumulation and kept in
float32, where transformers rounds them to the compute dtype first):
  "softmax_topk" (Mixtral, Qwen3-MoE): p = softmax(logits) in float32 over all E experts, the top k of p,
      divided by their sum when `normalize` (always for Mixtral, `norm_topk_prob` for Qwen3-MoE).
  "topk_softmax" (gpt-oss): logits = x W + b, the top k logits, softmax over those k.

Experts are dropless: each token reaches all of its k experts, no capacity factor. The T*k (token,
expert) pairs are sorted by expert (stable) and each projection is one grouped matmul over the sorted
rows; the outputs are put back in pair order, weighted by the routing weights in float32 and summed
over k. Two groupings compute the same numbers and are chosen when the step function is built
(`experts_for`, from `model.moe_impl`): `experts_padded` (the portable one: each expert's rows padded
to a multiple of `block_rows`, then one batched matmul over blocks, each block reading its expert's
kernels) and `experts_ragged_dot` (`jax.lax.ragged_dot`, or any grouped matmul of its signature
passed as `matmul`: on Hopper GPUs the Mosaic GPU kernels of `grouped_matmul`). JAX defines
ragged_dot's gradients, but outside TPUs it lowers to a dense masked expansion: every row against
every expert's kernel, E times the FLOPs and an (E, T*k, D) operand (on CPU with JAX 0.10.2, one
layer of 1024 tokens and 32 experts took 9 times padded's time; the same expansion is reported on
GPUs for JAX 0.9-0.11), hence padded off Hopper; `scripts/bench_moe.py` times them all.
Putting rows in and out of sorted order is a gather by a permutation, so the backward pass scatters
without collisions (deterministic on GPUs, unlike a scatter-add of T*k rows into T).

Load-balancing loss, as transformers' `load_balancing_loss_func` computes it from the router logits of
ALL layers concatenated (the Switch Transformer loss, scaled by E):

    loss = E * sum_e (C_e / R) * (P_e / R)

where, summed over layers and the (unmasked) tokens of one forward pass, C_e counts the top-k
assignments to expert e, P_e sums softmax(logits)[e] over all E experts in float32, and R counts the
rows (tokens x layers). The masked tokens are those transformers' attention mask zeroes: the engines
mask the padding that ends a row of fine-tuning examples (`jaxzero.numerics.objective.real_tokens`).
Because the counts and probabilities of every layer are divided by the total R, the loss is NOT the
sum (or mean) of per-layer losses. So each block emits its `RouterStats`
(C, P, R of its own layer; a few hundred bytes), the caller adds them over layers (`add_stats`, a
leaf-wise sum that is associative, so it can be accumulated as blocks run, streamed or not) and turns
the total into the loss once (`load_balancing_loss`): a model says its blocks emit them
(`jaxzero.models.emits_stats`, `block_stats`, `aux_loss`) and both engines add them up over the layers
of each micro-batch (`jaxzero.numerics.objective.objective_with_aux`, the streamed schedule), weighing
the loss by `router_aux_loss_coef`. The gradient flows through P only: the counts
come from integer expert ids. transformers computes the loss per forward call, so under gradient
accumulation each microbatch has its own loss over its own statistics. The top-k behind the counts
is the routing's own (transformers recomputes it from softmax(logits); softmax is monotone, so the
experts are the same for all three families).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp

from jaxzero.models import grouped_matmul, layers

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class MoeSpec:
    """What a family's MoE layer computes, beyond the array shapes.

    router: "softmax_topk" (softmax over all experts, then top-k) or "topk_softmax" (top-k logits,
    then softmax over the k). normalize: divide the top-k probabilities by their sum ("softmax_topk"
    only). activation: "swiglu" is silu(gate) * up; "clamped_swiglu" is gpt-oss's
    (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit). bias: the router
    and both expert projections carry biases (gpt-oss).
    """

    num_experts: int
    top_k: int
    router: Literal["softmax_topk", "topk_softmax"]
    normalize: bool
    activation: Literal["swiglu", "clamped_swiglu"]
    bias: bool
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"MoE top_k={self.top_k} must be between 1 and num_experts={self.num_experts}: each "
                "token is routed to top_k distinct experts."
            )
        if self.router not in ("softmax_topk", "topk_softmax"):
            raise ValueError(f"MoE router={self.router!r} is not 'softmax_topk' or 'topk_softmax'.")
        if self.activation not in ("swiglu", "clamped_swiglu"):
            raise ValueError(f"MoE activation={self.activation!r} is not 'swiglu' or 'clamped_swiglu'.")


def mixtral_spec(num_experts: int = 8, top_k: int = 2) -> MoeSpec:
    """Mixtral (`num_local_experts`, `num_experts_per_tok`): softmax, top-k, renormalised, SwiGLU.
    `router_jitter_noise` (training only; 0 in the released configs) is not modelled."""
    return MoeSpec(num_experts, top_k, "softmax_topk", normalize=True, activation="swiglu", bias=False)


def qwen3_moe_spec(num_experts: int, top_k: int, norm_topk_prob: bool) -> MoeSpec:
    """Qwen3-MoE (`num_experts`, `num_experts_per_tok`, `norm_topk_prob`): softmax, top-k, SwiGLU."""
    return MoeSpec(
        num_experts, top_k, "softmax_topk", normalize=norm_topk_prob, activation="swiglu", bias=False
    )


def gpt_oss_spec(
    num_experts: int, top_k: int, swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0
) -> MoeSpec:
    """gpt-oss (`num_local_experts`, `num_experts_per_tok`, `swiglu_alpha`, `swiglu_limit`): biased
    router, softmax over the top-k logits, clamped SwiGLU experts with biases."""
    return MoeSpec(
        num_experts,
        top_k,
        "topk_softmax",
        normalize=False,
        activation="clamped_swiglu",
        bias=True,
        swiglu_alpha=swiglu_alpha,
        swiglu_limit=swiglu_limit,
    )


class Routing(NamedTuple):
    """One layer's routing of T tokens: logits (T, E) float32, weights (T, k) float32 (the combine
    weights, gradients flow to the router through them), experts (T, k) int32 in [0, E), distinct per
    token, in descending order of score."""

    logits: jax.Array
    weights: jax.Array
    experts: jax.Array


class RouterStats(NamedTuple):
    """One layer's (or several layers' summed) load-balancing statistics, all float32: counts (E,) top-k
    assignments per expert, prob_sum (E,) softmax probabilities summed over tokens (differentiable),
    rows () tokens counted. Masked tokens count in none of them."""

    counts: jax.Array
    prob_sum: jax.Array
    rows: jax.Array


def init_moe(key: jax.Array, spec: MoeSpec, hidden: int, intermediate: int, std: float = 0.02) -> Params:
    """Float32 parameters (layout in the module docstring): normal(0, std) kernels, zero biases."""
    k_router, k_gate_up, k_down = jax.random.split(key, 3)
    E, D, F = spec.num_experts, hidden, intermediate
    params: Params = {
        "router": {"kernel": layers.normal(k_router, (D, E), std)},
        "gate_up": {"kernel": layers.normal(k_gate_up, (E, D, 2 * F), std)},
        "down": {"kernel": layers.normal(k_down, (E, F, D), std)},
    }
    if spec.bias:
        params["router"]["bias"] = jnp.zeros((E,), jnp.float32)
        params["gate_up"]["bias"] = jnp.zeros((E, 2 * F), jnp.float32)
        params["down"]["bias"] = jnp.zeros((E, D), jnp.float32)
    return params


def param_count(spec: MoeSpec, hidden: int, intermediate: int) -> int:
    """Elements of all leaves of `init_moe(key, spec, hidden, intermediate)`, from the shapes alone."""
    E, D, F = spec.num_experts, hidden, intermediate
    biases = (E + E * 2 * F + E * D) if spec.bias else 0
    return D * E + E * D * 2 * F + E * F * D + biases


def active_matmul_params(spec: MoeSpec, hidden: int, intermediate: int) -> int:
    """Kernel elements one token multiplies by: the router's and its k experts' (biases not counted).
    Times 6 is the layer's training FLOPs per token, the convention of `jaxzero.models.sizes`."""
    return hidden * spec.num_experts + spec.top_k * 3 * hidden * intermediate


def route(router: Params, x: jax.Array, spec: MoeSpec) -> Routing:
    """Route tokens x (T, D) in the compute dtype with the router's parameters ({"kernel": (D, E)},
    plus "bias" (E,) for gpt-oss). Returns `Routing` (float32 logits and weights, int32 experts)."""
    logits = jnp.dot(x, router["kernel"].astype(x.dtype), preferred_element_type=jnp.float32)
    if "bias" in router:
        logits = logits + router["bias"].astype(jnp.float32)[None, :]
    return route_logits(logits, spec)


def route_logits(logits: jax.Array, spec: MoeSpec) -> Routing:
    """The routing of router logits (T, E), computed in float32 (module docstring)."""
    logits = logits.astype(jnp.float32)
    if spec.router == "softmax_topk":
        probs = jax.nn.softmax(logits, axis=-1)
        weights, experts = jax.lax.top_k(probs, spec.top_k)
        if spec.normalize:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    else:
        top, experts = jax.lax.top_k(logits, spec.top_k)
        weights = jax.nn.softmax(top, axis=-1)
    return Routing(logits, weights, experts.astype(jnp.int32))


def router_stats(routing: Routing, mask: jax.Array | None = None) -> RouterStats:
    """This layer's load-balancing statistics (module docstring) from its routing; `mask`, bool or
    float of T elements in any shape ((B, S) included), marks the tokens that count (transformers'
    flattened attention mask), None counts all."""
    T, E = routing.logits.shape
    probs = jax.nn.softmax(routing.logits.astype(jnp.float32), axis=-1)
    m = jnp.ones((T,), jnp.float32) if mask is None else mask.astype(jnp.float32).reshape(T)
    k = routing.experts.shape[1]
    per_pair = jnp.broadcast_to(m[:, None], (T, k)).reshape(-1)
    counts = jnp.zeros((E,), jnp.float32).at[routing.experts.reshape(-1)].add(per_pair)
    prob_sum = jnp.sum(probs * m[:, None], axis=0)
    return RouterStats(jax.lax.stop_gradient(counts), prob_sum, jnp.sum(m))


def add_stats(a: RouterStats, b: RouterStats) -> RouterStats:
    """Leaf-wise sum: the statistics of the layers of `a` and of `b` together."""
    return RouterStats(a.counts + b.counts, a.prob_sum + b.prob_sum, a.rows + b.rows)


def sum_stats(stats: Sequence[RouterStats]) -> RouterStats:
    """The statistics of all layers in `stats` (one per layer), summed."""
    if not stats:
        raise ValueError("sum_stats needs the statistics of at least one layer; got none.")
    total = stats[0]
    for s in stats[1:]:
        total = add_stats(total, s)
    return total


def load_balancing_loss(stats: RouterStats) -> jax.Array:
    """transformers' `load_balancing_loss_func` from the statistics summed over all layers: a float32
    scalar, E * sum_e counts_e * prob_sum_e / rows**2. Multiply by `router_aux_loss_coef` to add it to
    the cross-entropy."""
    E = stats.counts.shape[0]
    return jnp.float32(E) * jnp.sum(stats.counts * stats.prob_sum) / (stats.rows * stats.rows)


def activation(h: jax.Array, spec: MoeSpec) -> jax.Array:
    """The experts' gated activation of h (N, 2F) laid out [gate | up] -> (N, F), in h's dtype."""
    gate, up = jnp.split(h, 2, axis=-1)
    if spec.activation == "swiglu":
        return jax.nn.silu(gate) * up
    limit = jnp.asarray(spec.swiglu_limit, h.dtype)
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    glu = gate * jax.nn.sigmoid(gate * jnp.asarray(spec.swiglu_alpha, h.dtype))
    return (up + 1) * glu


class _Sorted(NamedTuple):
    """The T*k (token, expert) pairs sorted by expert: order (N,) pair index of each sorted row,
    inverse (N,) sorted row of each pair, experts (N,) the sorted rows' experts, group_sizes (E,)."""

    order: jax.Array
    inverse: jax.Array
    experts: jax.Array
    group_sizes: jax.Array


def _sort_pairs(experts: jax.Array, num_experts: int) -> _Sorted:
    flat = experts.reshape(-1)
    n = flat.shape[0]
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    inverse = jnp.zeros((n,), jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32), unique_indices=True)
    group_sizes = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
    return _Sorted(order, inverse, flat[order], group_sizes)


def _gather_rows(x: jax.Array, top_k: int, s: _Sorted) -> jax.Array:
    """x (T, D) -> (T*k, D), row i the token of sorted pair i."""
    return jnp.repeat(x, top_k, axis=0).at[s.order].get(unique_indices=True)


def _combine(ys: jax.Array, weights: jax.Array, s: _Sorted, dtype: jnp.dtype) -> jax.Array:
    """Sorted expert outputs ys (T*k, D) -> (T, D): back in pair order, weighted in float32, summed."""
    T, k = weights.shape
    y = ys.at[s.inverse].get(unique_indices=True).reshape(T, k, ys.shape[-1])
    return jnp.sum(y.astype(jnp.float32) * weights.astype(jnp.float32)[:, :, None], axis=1).astype(dtype)


GroupedMatmul = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def experts_ragged_dot(
    params: Params,
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    spec: MoeSpec,
    *,
    matmul: GroupedMatmul = jax.lax.ragged_dot,
) -> jax.Array:
    """Dropless experts by a grouped matmul: x (T, D) in the compute dtype, weights (T, k) float32,
    experts (T, k) int32, params (gate_up, down; in x's dtype) -> (T, D) in x's dtype.

    `matmul(rows (N, I), kernels (E, I, O), group_sizes (E,) int32) -> (N, O)` multiplies each
    expert's consecutive rows by its kernel, as `jax.lax.ragged_dot` does; group sizes sum to N.
    """
    s = _sort_pairs(experts, spec.num_experts)
    xs = _gather_rows(x, experts.shape[1], s)
    h = _grouped(matmul, xs, params["gate_up"], s.group_sizes)
    ys = _grouped(matmul, activation(h, spec), params["down"], s.group_sizes)
    return _combine(ys, weights, s, x.dtype)


def _grouped(matmul: GroupedMatmul, rows: jax.Array, proj: Params, group_sizes: jax.Array) -> jax.Array:
    """rows (N, I) sorted by expert -> (N, O): each group's rows times its expert's kernel (E, I, O),
    plus its bias (E, O) where the projection has one, as one more row of the kernel against a
    column of ones. The bias's gradient is then the grouped matmul's own per-expert sum: adding
    bias[experts] instead scatter-adds every row's gradient into E rows (gpt-oss's layer on an H100:
    BENCHMARKS.md, "gpt-oss's experts on the Mosaic grouping")."""
    kernel = proj["kernel"]
    if "bias" not in proj:
        return matmul(rows, kernel, group_sizes)
    ones = jnp.ones((rows.shape[0], 1), rows.dtype)
    bias = proj["bias"].astype(kernel.dtype)[:, None, :]
    return matmul(jnp.concatenate([rows, ones], axis=1), jnp.concatenate([kernel, bias], axis=1), group_sizes)


# Rows per block of `experts_padded`: each expert's rows are padded to a multiple of this.
BLOCK_ROWS = 256


@jax.custom_vjp
def _block_kernels(kernel: jax.Array, block_expert: jax.Array) -> jax.Array:
    """Each block's expert's kernel: kernel (E, I, O) (or a bias (E, O)), block_expert (blocks,)
    int32 ascending -> (blocks, I, O) in kernel's dtype. Its gradient sums the blocks of each expert
    in float32 and rounds once to kernel's dtype: a bfloat16 scatter-add would round after every
    block, an error growing with the expert's blocks where a dense layer's kernel gradient rounds once."""
    return kernel[block_expert]


def _block_kernels_fwd(kernel: jax.Array, block_expert: jax.Array) -> tuple[jax.Array, tuple]:
    return kernel[block_expert], (kernel, block_expert)  # the kernel is an input: no copy


def _block_kernels_bwd(res: tuple, g: jax.Array) -> tuple[jax.Array, None]:
    kernel, block_expert = res
    # A scatter-add into float32 zeros: `segment_sum` with sorted indices crashed XLA's GPU compiler
    # (BENCHMARKS.md, "What the padded expert grouping holds on the GPU"); this compiles there.
    total = jnp.zeros(kernel.shape, jnp.float32).at[block_expert].add(g.astype(jnp.float32))
    return total.astype(kernel.dtype), None


_block_kernels.defvjp(_block_kernels_fwd, _block_kernels_bwd)


def experts_padded(
    params: Params,
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    spec: MoeSpec,
    *,
    block_rows: int = BLOCK_ROWS,
) -> jax.Array:
    """Dropless experts without `ragged_dot`: the same contract as `experts_ragged_dot`.

    Each expert's sorted rows start a fresh block of `block_rows` rows (its last block zero-padded);
    the N = T*k rows need at most ceil(N / block_rows) + E blocks, a static bound. Each block gathers
    its expert's kernels (blocks x D x 2F values) and one batched matmul computes all blocks; padding
    rows are computed and never read back. Costs up to E * block_rows rows of padding and the gathered
    kernels' memory; no loop over experts.
    """
    T, k = experts.shape
    D = x.shape[1]
    E, B = spec.num_experts, block_rows
    n = T * k
    blocks = -(-n // B) + E
    s = _sort_pairs(experts, E)
    padded = (s.group_sizes + (B - 1)) // B * B
    padded_end = jnp.cumsum(padded)
    group_start = jnp.cumsum(s.group_sizes) - s.group_sizes
    dest = (padded_end - padded)[s.experts] + jnp.arange(n, dtype=jnp.int32) - group_start[s.experts]
    xp = jnp.zeros((blocks * B, D), x.dtype).at[dest].set(_gather_rows(x, k, s), unique_indices=True)
    block_expert = jnp.searchsorted(padded_end, jnp.arange(blocks, dtype=jnp.int32) * B, side="right")
    block_expert = jnp.minimum(block_expert, E - 1)

    def project(rows: jax.Array, proj: Params) -> jax.Array:
        out = jnp.einsum("nbi,nio->nbo", rows, _block_kernels(proj["kernel"], block_expert))
        if "bias" not in proj:
            return out
        # The add in float32: its gradient, each block's rows summed, then accumulates in float32
        # and rounds once (`_block_kernels`); the forward rounds the same sum once as before.
        bias = _block_kernels(proj["bias"].astype(jnp.float32), block_expert)[:, None, :]
        return (out.astype(jnp.float32) + bias).astype(out.dtype)

    h = project(xp.reshape(blocks, B, D), params["gate_up"])
    yp = project(activation(h, spec), params["down"]).reshape(blocks * B, D)
    return _combine(yp.at[dest].get(unique_indices=True), weights, s, x.dtype)


ExpertsFn = Callable[[Params, jax.Array, jax.Array, jax.Array, MoeSpec], jax.Array]

EXPERTS: dict[str, ExpertsFn] = {"ragged_dot": experts_ragged_dot, "padded": experts_padded}


def experts_for(requested: str, dtype: jnp.dtype) -> ExpertsFn:
    """The grouping `model.moe_impl=requested` runs as on this process's backend, for experts in
    `dtype` (`grouped_matmul.experts_impl`): the padded blocks, or the grouped
    matmul of the Mosaic GPU kernels. Called when the step is traced."""
    if grouped_matmul.experts_impl(requested, dtype) == "mosaic":
        return functools.partial(experts_ragged_dot, matmul=grouped_matmul.mosaic_matmul())
    return experts_padded


def moe_block(
    params: Params, x: jax.Array, spec: MoeSpec, *, experts_fn: ExpertsFn = experts_padded
) -> tuple[jax.Array, Routing]:
    """The sparse MoE layer: x (..., D) in the compute dtype -> (y (..., D) in x's dtype, `Routing` of
    the T = prod(...) tokens flattened). Parameters are cast to x's dtype (free when they already are);
    the router runs on them with float32 logits. `experts_fn` is one of `EXPERTS`, chosen when the step
    function is built."""
    shape = x.shape
    D = shape[-1]
    if params["router"]["kernel"].shape != (D, spec.num_experts):
        raise ValueError(
            f"MoE router kernel has shape {params['router']['kernel'].shape}; expected (hidden={D}, "
            f"num_experts={spec.num_experts}) for input of shape {shape}: check the spec against the weights."
        )
    xt = x.reshape(-1, D)
    routing = route(params["router"], xt, spec)
    expert_params = layers.cast_tree({"gate_up": params["gate_up"], "down": params["down"]}, x.dtype)
    y = experts_fn(expert_params, xt, routing.weights, routing.experts, spec)
    return y.reshape(shape), routing


def moe_layer(
    params: Params, x: jax.Array, spec: MoeSpec, impl: str, token_mask: jax.Array | None = None
) -> tuple[jax.Array, RouterStats]:
    """A family's sparse MLP: `moe_block` with the experts grouped as `model.moe_impl=impl` runs on
    this backend (`experts_for`, decided when the step is traced), and the layer's `RouterStats`
    over the tokens where `token_mask` (bool, x's leading shape) is True, every token without one."""
    experts = experts_for(impl, x.dtype)
    y, routing = moe_block(params, x, spec, experts_fn=experts)
    return y, router_stats(routing, token_mask)

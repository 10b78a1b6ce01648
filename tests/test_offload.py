"""The offload engine against the resident reference trainer, and where it keeps each array.

Tolerances are fixed once. The engine and the reference run the same math in different XLA programs
(different fusion and reduction orders), so they agree to rounding, not bitwise:
- float32 compute: per-step losses within 1e-5 absolute; final parameters within 2e-5 relative per leaf.
- bfloat16 compute: losses within 2e-3, parameters within 2e-2 (bf16 carries 8 bits of mantissa).

GPT-2's and Qwen2's key biases are left out of the parameter comparison: softmax is invariant to
adding one vector to every key, so its exact gradient is zero and what it receives is rounding noise,
which Adam's division by sqrt(v) turns into full-size, run-specific steps. Both trainers do that;
neither is wrong.
"""

import dataclasses

import jax
import numpy as np
import pytest

from jaxzero.config import TrainConfig
from jaxzero.data import build_data
from jaxzero.models import Llama
from jaxzero.offload import OffloadState
from jaxzero.overrides import apply_overrides
from jaxzero.plan import placement
from jaxzero.trainer import build_trainer

STEPS = 4
MODES = {
    "zero-offload": {"offload.optimizer": "cpu"},
    "zero3-offload": {"offload.optimizer": "cpu", "offload.params": "cpu"},
    "partial": {"offload.optimizer": "cpu", "offload.params": "cpu", "offload.resident_blocks": "1"},
    "zero3-offload-bf16-moments": {
        "offload.optimizer": "cpu",
        "offload.params": "cpu",
        "optimizer.state_dtype": "bfloat16",
    },
    # The host update as optax's own XLA:CPU program instead of the fused kernels.
    "zero3-offload-optax": {
        "offload.optimizer": "cpu",
        "offload.params": "cpu",
        "offload.fused_update": "false",
    },
}
# Units whose masters and state stay on the accelerator, updated there, beside host-updated ones.
MIXED = {
    # the embedding and block 0 on the accelerator; blocks 1-2 streamed, their state and the head's
    # on the host
    "zero3-mixed": {"offload.optimizer": "cpu", "offload.params": "cpu", "offload.device_state_units": "2"},
    # every unit but the head on the accelerator
    "zero-offload-mixed": {"offload.optimizer": "cpu", "offload.device_state_units": "4"},
    "zero3-mixed-optax": {
        "offload.optimizer": "cpu",
        "offload.params": "cpu",
        "offload.device_state_units": "1",
        "offload.fused_update": "false",
    },
}
# Relative error of final parameters and absolute error of per-step losses.
TOLERANCE = {"float32": (2e-5, 1e-5), "bfloat16": (2e-2, 2e-3)}


def tiny(family: str, dtype: str, **over) -> TrainConfig:
    return apply_overrides(
        TrainConfig(),
        {
            "model.name": f"{family}-tiny",
            "model.num_layers": "3",
            "model.compute_dtype": dtype,
            "data.seq_len": "32",
            "data.batch_size": "8",
            "data.grad_accum": "2",
            "steps": str(STEPS),
            "optimizer.grad_clip": "0.5",
            "optimizer.warmup_steps": "2",
            "optimizer.lr": "1e-2",
            **over,
        },
    )


def run(cfg: TrainConfig, guard: bool = False):
    mesh = placement.make_mesh(jax.devices()[:1])
    trainer = build_trainer(cfg, mesh)
    data = build_data(cfg.data, cfg.model.vocab_size, cfg.seed)
    batches = data.train_iter()
    key = jax.random.key(cfg.seed)  # made from a Python int: an implicit transfer, outside the guard
    # The guard is set for the whole process, so the engine's worker threads (the host update) run
    # under it too: an implicit transfer there, such as a NumPy scalar handed to a jitted function,
    # lands on the default device (the accelerator) and waits behind its queue.
    previous = jax.config.jax_transfer_guard
    jax.config.update("jax_transfer_guard", "disallow" if guard else "allow")
    try:
        state = trainer.init(key)
        losses, norms = [], []
        for _ in range(cfg.steps):
            state, m = trainer.step(state, trainer.put_batch(next(batches)))
            m = jax.device_get(m)
            losses.append(float(m.loss))
            norms.append(float(m.grad_norm))
        val = jax.device_get(trainer.eval_loss(state, trainer.put_eval_batch(data.val_batches(1)[0])))
        jax.block_until_ready(state)  # the last host updates, still under the guard
    finally:
        jax.config.update("jax_transfer_guard", previous)
    return trainer, state, np.array(losses), np.array(norms), float(val)


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(family, dtype, state_dtype=None):
        key = (family, dtype, state_dtype)
        if key not in cache:
            over = {"optimizer.state_dtype": state_dtype} if state_dtype else {}
            cache[key] = run(tiny(family, dtype, **over))
        return cache[key]

    return get


CASES = [(mode, family, "float32") for mode in MODES for family in ("llama", "gpt2")]
CASES += [("zero3-offload", family, "bfloat16") for family in ("llama", "gpt2")]
CASES += [(mode, family, "float32") for mode in MIXED for family in ("llama", "gpt2")]
CASES += [("zero3-mixed", "llama", "bfloat16")]


@pytest.mark.parametrize("mode, family, dtype", CASES)
def test_offload_matches_resident(references, family, dtype, mode):
    over = {**MODES, **MIXED}[mode]
    _, ref_state, ref_losses, ref_norms, ref_val = references(
        family, dtype, over.get("optimizer.state_dtype")
    )
    _, state, losses, norms, val = run(tiny(family, dtype, **over), guard=True)
    # Moments stored in bf16 round like bf16 compute does: float32 rounding differences between the two
    # programs occasionally flip a bf16 rounding, so that mode gets the bf16 tolerances.
    bf16_state = over.get("optimizer.state_dtype") == "bfloat16"
    param_tol, loss_tol = TOLERANCE["bfloat16" if bf16_state else dtype]
    assert ref_norms[0] > 0.5, "clipping must be active in the compared steps"
    np.testing.assert_allclose(losses, ref_losses, atol=loss_tol, rtol=0)
    np.testing.assert_allclose(norms, ref_norms, rtol=param_tol)
    assert abs(val - ref_val) < loss_tol
    assert losses[-1] < losses[0]
    ref_params = jax.device_get(ref_state.params)
    params = jax.device_get(state.params)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(ref_params)):
        name = jax.tree_util.keystr(path)
        if name.endswith("['c_attn']['bias']"):  # drop the key third: see the module docstring
            d = a.shape[0] // 3
            a, b = np.concatenate([a[:d], a[2 * d :]]), np.concatenate([b[:d], b[2 * d :]])
        assert rel(a, b) < param_tol, name


# The Llama family's released variants: Qwen2's q, k, v biases with Llama 3.1's rope scaling.
VARIANT = {
    "model.attention_bias": "true",
    "model.hf_model_type": "qwen2",
    "model.rope_type": "llama3",
    "model.rope_factor": "8",
    "model.rope_original_max_len": "16",
}


def offloads_like_resident(
    variant: dict[str, str],
    offload: dict[str, str] = MODES["zero3-offload"],
    guard: bool = True,
    unchecked=None,
) -> list:
    """`variant` of the tiny float32 Llama trained resident and with `offload` (under the transfer
    guard with `guard`): the losses, gradient norms and validation loss agree, the loss falls, and every
    parameter agrees under the same name but those whose path ends with `unchecked`. Returns the
    offloaded run's parameters as (path, leaf) pairs, for a test's own checks."""
    _, ref_state, ref_losses, ref_norms, ref_val = run(tiny("llama", "float32", **variant))
    _, state, losses, norms, val = run(tiny("llama", "float32", **variant, **offload), guard=guard)
    param_tol, loss_tol = TOLERANCE["float32"]
    np.testing.assert_allclose(losses, ref_losses, atol=loss_tol, rtol=0)
    np.testing.assert_allclose(norms, ref_norms, rtol=param_tol)
    assert abs(val - ref_val) < loss_tol and losses[-1] < losses[0]
    flat = jax.tree_util.tree_flatten_with_path(jax.device_get(state.params))[0]
    ref = jax.tree_util.tree_flatten_with_path(jax.device_get(ref_state.params))[0]
    assert len(flat) == len(ref)
    for (path, a), (ref_path, b) in zip(flat, ref):
        name = jax.tree_util.keystr(path)
        assert name == jax.tree_util.keystr(ref_path)
        if unchecked is None or not name.endswith(unchecked):
            assert rel(a, b) < param_tol, name
    return flat


@pytest.mark.parametrize("mode", ["zero3-offload", "zero3-mixed"])
def test_biased_llama3_rope_variant_offloads_like_resident(mode):
    # the k_proj bias: see the module docstring
    flat = offloads_like_resident(
        VARIANT, {**MODES, **MIXED}[mode], guard=False, unchecked="['k_proj']['bias']"
    )
    assert any(jax.tree_util.keystr(p).endswith("['q_proj']['bias']") for p, _ in flat)


# Qwen3's block: q/k norms (unit parameters, streamed and updated with the rest) and heads of a width
# of their own (48, where hidden_size / num_heads is 32).
QWEN3 = {"model.qk_norm": "true", "model.head_size": "48", "model.hf_model_type": "qwen3"}


def test_qwen3_block_offloads_like_resident():
    norms = [
        a for p, a in offloads_like_resident(QWEN3) if jax.tree_util.keystr(p).endswith("_norm']['scale']")
    ]
    assert len(norms) == 2 * 3
    for a in norms:
        assert np.asarray(a).shape == (48,) and not np.allclose(a, 1.0)  # trained, not left at init


# Phi-3's block (q, k, v and gate, up fused; rope over half of each head) and OLMo 2's (norms after
# each sub-block; q/k norms over the whole projections, widths N*H and K*H).
PHI3 = {"model.fused_projections": "true", "model.partial_rotary_factor": "0.5",
        "model.hf_model_type": "phi3"}  # fmt: skip
OLMO2 = {"model.qk_norm": "true", "model.qk_norm_scope": "projection", "model.post_norm": "true",
         "model.hf_model_type": "olmo2"}  # fmt: skip


@pytest.mark.parametrize("variant", [PHI3, OLMO2], ids=["phi3", "olmo2"])
def test_phi3_and_olmo2_blocks_offload_like_resident(variant):
    names = {jax.tree_util.keystr(p) for p, _ in offloads_like_resident(variant)}
    fused = ".blocks[0]['self_attn']['qkv_proj']['kernel']"
    after = ".blocks[0]['post_feedforward_layernorm']['scale']"
    assert any(n.endswith(fused if variant is PHI3 else after) for n in names), sorted(names)[:8]


# A Gemma 3 shape: layers 0 and 2 local (window 8 of the 32 positions), layer 1 global, each kind with its
# rope base: one block program, the layer's kind its per-layer input.
GEMMA3 = {
    "model.family": "gemma3",
    "model.tie_embeddings": "true",
    "model.head_size": "48",
    "model.sliding_window": "8",
    "model.sliding_window_pattern": "2",
    "model.rope_local_theta": "1e4",
    "model.query_pre_attn_scalar": "24",
    "model.final_logit_softcap": "30",
    "model.hf_model_type": "gemma3_text",
}


def test_gemma3_block_offloads_like_resident():
    offloads_like_resident(GEMMA3)


# gpt-oss: layers 0 and 2 local (window 8 of the 32 positions), layer 1 global; q, k, v and o biased,
# a sink per head, yarn rope, 4 biased clamped-SwiGLU experts of width 64, top 2.
GPT_OSS = {
    "model.family": "gpt_oss",
    "model.head_size": "48",
    "model.attention_bias": "true",
    "model.num_experts": "4",
    "model.num_experts_per_tok": "2",
    "model.moe_intermediate_size": "64",
    "model.sliding_window": "8",
    "model.sliding_window_pattern": "2",
    "model.rope_type": "yarn",
    "model.rope_factor": "32",
    "model.rope_original_max_len": "64",
    "model.hf_model_type": "gpt_oss",
}


def test_gpt_oss_block_offloads_like_resident():
    """Its sinks, biases and experts are streamed and updated on the host with gradient accumulation,
    as the resident trainer trains them; its windows reach the one block program as per-layer inputs."""
    offloads_like_resident(GPT_OSS, unchecked="['k_proj']['bias']")  # see the module docstring


# A mixture of experts: every block's MLP 4 SwiGLU experts of width 64, each token through its top 2
# (Mixtral's routing), trained through both micro-batches of each step.
MOE = {"model.num_experts": "4", "model.num_experts_per_tok": "2", "model.moe_intermediate_size": "64"}


def test_moe_block_offloads_like_resident():
    """Routers and experts are block parameters like any: streamed, updated on the host, with
    gradient accumulation, as the resident trainer trains them (the routing itself is equal: a
    flipped expert choice would move the losses far past the tolerance)."""
    names = [jax.tree_util.keystr(p) for p, _ in offloads_like_resident(MOE)]
    seen = {n.split("['mlp']")[1] for n in names if "['mlp']" in n}
    assert seen == {"['router']['kernel']", "['gate_up']['kernel']", "['down']['kernel']"}


# Granite MoE: the same experts under Granite's four scalars, with the load-balancing loss.
GRANITE_MOE = {**MOE, "model.hf_model_type": "granitemoe", "model.tie_embeddings": "true",
               "model.embedding_multiplier": "12", "model.residual_multiplier": "0.22",
               "model.attention_multiplier": "0.125", "model.logits_scaling": "6",
               "model.router_aux_loss_coef": "0.05"}  # fmt: skip


def test_granitemoe_block_offloads_like_resident():
    """Granite's scaled embeddings, residuals, scores and logits stream and train as resident."""
    offloads_like_resident(GRANITE_MOE)


def train_moe(cfg: TrainConfig, model=None):
    """`run`'s loop for a mixture of experts: (state, losses, aux losses, norms), with `model` in place
    of cfg.model's where given."""
    trainer = build_trainer(cfg, placement.make_mesh(jax.devices()[:1]), model=model)
    batches = build_data(cfg.data, cfg.model.vocab_size, cfg.seed).train_iter()
    state = trainer.init(jax.random.key(cfg.seed))
    metrics = []
    for _ in range(cfg.steps):
        state, m = trainer.step(state, trainer.put_batch(next(batches)))
        metrics.append(jax.device_get(m))
    jax.block_until_ready(state)
    losses, norms = (np.array([float(getattr(m, k)) for m in metrics]) for k in ("loss", "grad_norm"))
    aux = [None if m.aux_loss is None else float(m.aux_loss) for m in metrics]
    return state, losses, aux, norms


# The load-balancing loss weighted far above the released coefficients, so that its gradient shows.
AUX = {**MOE, "model.router_aux_loss_coef": "0.05"}


def test_moe_load_balancing_loss_offloads_like_resident():
    """CE + coef x the load-balancing loss of each micro-batch (two a step), its statistics summed over
    the streamed blocks and its cotangent fed to each block's backward pass, with the block inputs
    waiting in pinned_host: the offload engine trains as the resident trainer differentiates the
    whole objective, and both report the same unweighted `aux_loss` beside the cross-entropy."""
    param_tol, loss_tol = TOLERANCE["float32"]
    ref_state, ref_losses, ref_aux, ref_norms = train_moe(tiny("llama", "float32", **AUX))
    offload = {**MODES["zero3-offload"], "offload.activations": "cpu"}
    state, losses, aux, norms = train_moe(tiny("llama", "float32", **AUX, **offload))
    np.testing.assert_allclose(losses, ref_losses, atol=loss_tol, rtol=0)
    np.testing.assert_allclose(aux, ref_aux, atol=loss_tol, rtol=0)
    np.testing.assert_allclose(norms, ref_norms, rtol=param_tol)
    for a, b in zip(jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(ref_state.params)):
        assert rel(a, b) < param_tol
    # The coefficient moved the parameters: the same run on the cross-entropy alone ends elsewhere.
    ce_state, _, ce_aux, _ = train_moe(tiny("llama", "float32", **MOE))
    assert ce_aux[0] == pytest.approx(ref_aux[0], abs=loss_tol)  # the same first step's statistics
    router = lambda s: np.asarray(jax.device_get(s.params.blocks[0]["mlp"]["router"]["kernel"]))  # noqa: E731
    assert rel(router(ce_state), router(ref_state)) > 100 * param_tol


@dataclasses.dataclass(frozen=True)
class CrossEntropyOnly(Llama):
    """The experts' model trained as before the load-balancing loss: its blocks emit no statistics."""

    @property
    def emits_stats(self) -> bool:
        return False


@pytest.mark.parametrize("mode", ["resident", "zero3-offload"])
def test_moe_with_coefficient_zero_trains_bitwise_as_the_cross_entropy_alone(mode):
    """router_aux_loss_coef=0: the statistics are summed for `aux_loss` alone; the parameters are those
    of the cross-entropy's objective bit for bit, in either engine."""
    cfg = tiny("llama", "float32", **MOE, **MODES.get(mode, {}))
    state, losses, aux, _ = train_moe(cfg)
    ce_state, ce_losses, ce_aux, _ = train_moe(cfg, model=CrossEntropyOnly(cfg.model))
    assert all(a is not None for a in aux) and ce_aux == [None] * STEPS
    np.testing.assert_array_equal(losses, ce_losses)
    for a, b in zip(jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(ce_state.params)):
        np.testing.assert_array_equal(a, b)


# Rows of fine-tuning examples ending with end-of-text id 7, padded as the data pads them; the
# load-balancing loss weighted as in AUX.
PADDED = {**AUX, "data.eot_id": "7"}


def example_rows(cfg: TrainConfig, lengths: list[int]) -> np.ndarray:
    """int32 (steps, A, mb, S+1): one example per row as `jaxzero.data.packing` lays rows out (its
    prompt's 3 tokens not targets, its end-of-text last, then the padding), each example of the
    given length in turn (the row's width or more: no padding)."""
    from jaxzero.config import padding_id
    from jaxzero.data.packing import _gather_rows  # the data's own layout of rows

    d, eot = cfg.data, cfg.data.eot_id
    width, n = d.seq_len + 1, cfg.steps * d.batch_size
    lengths = np.resize(np.asarray(lengths, np.int64), n)
    rng = np.random.default_rng(0)
    tokens = rng.integers(8, cfg.model.vocab_size, size=int(lengths.sum()))  # no 7 among them
    ends = np.cumsum(lengths)
    tokens[ends - 1] = eot
    starts = ends - lengths
    counted = np.ones(tokens.size, bool)
    for s in starts:
        counted[s : s + 3] = False
    rows = [np.asarray([i]) for i in range(n)]
    out = _gather_rows(tokens, counted, starts, lengths, rows, width, padding_id(eot))
    return out.reshape(cfg.steps, d.grad_accum, -1, width)


def train_rows(cfg: TrainConfig, rows: np.ndarray, model=None):
    """`train_moe` over the given batches `rows`."""
    trainer = build_trainer(cfg, placement.make_mesh(jax.devices()[:1]), model=model)
    state = trainer.init(jax.random.key(cfg.seed))
    metrics = []
    for batch in rows:
        state, m = trainer.step(state, trainer.put_batch(batch))
        metrics.append(jax.device_get(m))
    jax.block_until_ready(state)
    losses, norms = (np.array([float(getattr(m, k)) for m in metrics]) for k in ("loss", "grad_norm"))
    return state, losses, [float(m.aux_loss) for m in metrics], norms


@dataclasses.dataclass(frozen=True)
class EveryToken(Llama):
    """The experts' model counting every position in its router's statistics, the rows' padding
    included: its `block_stats` takes no `token_mask` (`objective.router_padding`)."""

    def block_stats(self, block_params, x, segments=None, dropout_key=None):
        return super().block_stats(block_params, x, segments, dropout_key)


def test_moe_padding_counts_in_no_router_statistics_offloaded_as_resident():
    """Rows padded after their example (grad accumulation of two micro-batches, the block inputs in
    pinned_host): the padding counts in none of the load-balancing loss's statistics, whose sum the
    streamed blocks add and whose cotangent each block's backward takes, as the resident trainer
    differentiates it; counting it (a model without `token_mask`) gives another loss."""
    param_tol, loss_tol = TOLERANCE["float32"]
    cfg = tiny("llama", "float32", **PADDED)
    rows = example_rows(cfg, [10, 33, 20, 5, 40, 28, 17])
    assert (rows[..., -1] == ~0).mean() > 0.5  # most rows end with padding
    ref_state, ref_losses, ref_aux, ref_norms = train_rows(cfg, rows)
    offload = {**MODES["zero3-offload"], "offload.activations": "cpu"}
    state, losses, aux, norms = train_rows(tiny("llama", "float32", **PADDED, **offload), rows)
    np.testing.assert_allclose(losses, ref_losses, atol=loss_tol, rtol=0)
    np.testing.assert_allclose(aux, ref_aux, atol=loss_tol, rtol=0)
    np.testing.assert_allclose(norms, ref_norms, rtol=param_tol)
    for a, b in zip(jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(ref_state.params)):
        assert rel(a, b) < param_tol
    _, _, every_aux, _ = train_rows(cfg, rows, model=EveryToken(cfg.model))
    assert abs(every_aux[0] - ref_aux[0]) > 100 * loss_tol


@pytest.mark.parametrize("mode", ["resident", "resident-one-micro-batch", "zero3-offload"])
def test_moe_rows_without_padding_train_as_counting_every_token(mode):
    """Rows of examples that fill them (no padding), with an end-of-text id: the token mask changes
    nothing, with or without gradient accumulation: bit for bit in the streamed blocks' programs, to
    rounding in the resident engine's whole-model program (a mask of ones fused into it may round
    its gradients by an ulp; one program with the mask compiles once, where a second would double it)."""
    one = {"data.grad_accum": "1"} if mode == "resident-one-micro-batch" else {}
    cfg = tiny("llama", "float32", **PADDED, **MODES.get(mode, {}), **one)
    rows = example_rows(cfg, [33, 40])
    state, losses, aux, _ = train_rows(cfg, rows)
    every_state, every_losses, every_aux, _ = train_rows(cfg, rows, model=EveryToken(cfg.model))
    params = jax.tree.leaves(jax.device_get(state.params))
    if mode == "zero3-offload":
        np.testing.assert_array_equal(losses, every_losses)
        np.testing.assert_array_equal(aux, every_aux)
        for a, b in zip(params, jax.tree.leaves(every_state.params)):
            np.testing.assert_array_equal(a, b)
        return
    param_tol, loss_tol = TOLERANCE["float32"]
    np.testing.assert_allclose(losses, every_losses, atol=loss_tol, rtol=0)
    np.testing.assert_allclose(aux, every_aux, atol=loss_tol, rtol=0)
    for a, b in zip(params, jax.tree.leaves(every_state.params)):
        assert rel(a, b) < param_tol


def kinds(tree) -> set:
    return {(x.sharding.memory_kind, next(iter(x.devices())).platform) for x in jax.tree.leaves(tree)}


@pytest.mark.parametrize("mode", list(MODES))
def test_placement_is_asserted(mode):
    cfg = tiny("llama", "bfloat16", steps="1", **MODES[mode])
    trainer, state, *_ = run(cfg, guard=True)
    assert isinstance(state, OffloadState)
    host = jax.devices("cpu")[0]
    for tree in (state.params, state.opt_state, state.step):
        for x in jax.tree.leaves(tree):
            assert x.devices() == {host}, "masters and optimizer state live on the host"
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {np.dtype("float32")}
    assert {x.dtype for x in jax.tree.leaves(state.weights)} == {np.dtype(jax.numpy.bfloat16)}
    assert kinds(state.weights.embed) == kinds(state.weights.head) == {("device", "cpu")}
    resident = {"zero-offload": 3, "partial": 1}.get(mode, 0)
    for i, block in enumerate(state.weights.blocks):
        expected = "device" if i < resident else "pinned_host"
        assert kinds(block) == {(expected, "cpu")}, (i, kinds(block))


@pytest.mark.parametrize("mode", list(MIXED))
def test_units_with_state_on_the_accelerator_keep_it_there(mode):
    cfg = tiny("llama", "bfloat16", steps="2", **MIXED[mode])
    on_device = cfg.offload.device_state_units
    trainer, state, *_ = run(cfg, guard=True)
    host = jax.devices("cpu")[0]
    units = state.units.units()
    for k, unit in enumerate(units):
        u = unit.result()
        where = kinds((u.params, u.opt_state))
        if k < on_device:
            assert where == {("device", "cpu")}, (k, where)
            # No compute-dtype copy beside the masters: the passes read the masters themselves.
            assert all(w is p for w, p in zip(jax.tree.leaves(u.weights), jax.tree.leaves(u.params))), k
            assert {x.dtype for x in jax.tree.leaves(u.weights)} == {np.dtype("float32")}, k
        else:
            for x in jax.tree.leaves((u.params, u.opt_state)):
                assert x.devices() == {host}, k
    # A step consumes the old masters of the units it updates on the accelerator (donated: never two
    # copies there).
    old = [x for unit in units[:on_device] for x in jax.tree.leaves(unit.result().weights)]
    state, _ = trainer.step(state, trainer.put_batch(next(build_data(cfg.data, 256, 0).train_iter())))
    assert all(x.is_deleted() for x in old)
    units = state.units.units()
    # A checkpoint sees every unit as host state, whatever the plan: its layout never depends on it.
    saved = trainer.saved_state(state)
    assert {x.sharding.mesh.devices.flat[0] for x in jax.tree.leaves(saved)} == {host}


@pytest.mark.parametrize("device_state_units", ["0", "2"])
def test_block_inputs_in_pinned_host_change_nothing_but_where_they_wait(monkeypatch, device_state_units):
    """offload.activations=cpu: every block input but the last leaves for pinned_host in the forward
    pass and comes back for the backward pass; the arithmetic is untouched, so the run is bitwise
    the run that keeps them on the accelerator."""
    from jaxzero.offload import streaming

    over = {**MODES["zero3-offload"], "offload.device_state_units": device_state_units}
    cfg = tiny("llama", "float32", **over)
    _, ref_state, ref_losses, ref_norms, ref_val = run(cfg)
    activation_shape = (cfg.data.grad_accum, cfg.data.batch_size // cfg.data.grad_accum, cfg.data.seq_len)
    moves = []
    real_copy_to = streaming.copy_to

    def recording(tree, targets):
        if getattr(tree, "shape", ())[:3] == activation_shape:
            moves.append(targets.memory_kind)
        return real_copy_to(tree, targets)

    monkeypatch.setattr(streaming, "copy_to", recording)
    _, state, losses, norms, val = run(tiny("llama", "float32", **over, **{"offload.activations": "cpu"}))
    blocks = cfg.model.num_layers
    assert moves == (["pinned_host"] * (blocks - 1) + ["device"] * (blocks - 1)) * cfg.steps
    np.testing.assert_array_equal(losses, ref_losses)
    np.testing.assert_array_equal(norms, ref_norms)
    assert val == ref_val
    for a, b in zip(
        jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(jax.device_get(ref_state.params))
    ):
        np.testing.assert_array_equal(a, b)


def test_gradients_land_in_pinned_host():
    cfg = tiny("llama", "bfloat16", **MODES["zero3-offload"], **{"data.grad_accum": "1"})
    trainer = build_trainer(cfg, placement.make_mesh(jax.devices()[:1]))
    from jaxzero.offload.streaming import StreamedModel

    state = trainer.init(jax.random.key(0))
    where = placement.offload_placement(trainer.mesh, trainer.plan)
    streamed = StreamedModel(trainer.model, where, grad_accum=1)
    batch = build_data(cfg.data, 256, 0).train_iter().__next__()  # (1, 8, 33): one micro-batch
    seed = jax.device_put(np.float32(1.0), where.device)  # no loss scale
    with jax.transfer_guard("disallow"):
        loss, grads, norm, _ = streamed.grads(state.weights, trainer.put_batch(batch), seed)
    assert kinds(grads) == {("pinned_host", "cpu")}
    # One micro-batch: block gradients leave in the compute dtype (exact, half the link bytes).
    assert {x.dtype for x in jax.tree.leaves(grads.blocks)} == {np.dtype(jax.numpy.bfloat16)}


def test_timings_report_every_breakdown_key():
    from jaxzero.state import BREAKDOWN

    trainer, *_ = run(tiny("llama", "float32", steps="1", **MODES["zero3-offload"]))
    assert list(trainer.timings(1.0, 1)) == [k.key for k in BREAKDOWN]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_unclipped_updates_overlap_the_backward_pass_and_match_resident(family):
    """Without clipping no unit waits for the global norm: each updates as soon as its gradients land."""
    over = {"optimizer.grad_clip": "0"}
    _, ref_state, ref_losses, ref_norms, _ = run(tiny(family, "float32", **over))
    _, state, losses, norms, _ = run(tiny(family, "float32", **MODES["zero3-offload"], **over), guard=True)
    param_tol, loss_tol = TOLERANCE["float32"]
    np.testing.assert_allclose(losses, ref_losses, atol=loss_tol, rtol=0)
    np.testing.assert_allclose(norms, ref_norms, rtol=param_tol)
    for a, b in zip(
        jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(jax.device_get(ref_state.params))
    ):
        if a.ndim == 2:  # matrices (GPT-2's key bias: see the module docstring)
            assert rel(a, b) < param_tol


@pytest.mark.parametrize("mode", ["zero-offload", "zero3-offload"])
def test_delayed_update_is_the_reference_shifted_by_one_step(mode):
    """offload.update=delayed (DPU): the gradient of step k is taken at the weights from before update
    k-1 (w_{k-2}, with w_{-1} = w_0) and applied to the newest masters. The oracle is that rule written
    out with optax on whole parameters; the same tolerances as offload == resident."""
    from jaxzero.numerics.optim import build_optimizer
    from jaxzero.resident import averaged_grads

    cfg = tiny("llama", "float32", **MODES[mode], **{"offload.update": "delayed"})
    trainer, state, losses, norms, _ = run(cfg, guard=True)

    tx = build_optimizer(cfg.optimizer, cfg.steps)
    params = jax.device_get(
        build_trainer(cfg, placement.make_mesh(jax.devices()[:1])).init(jax.random.key(0)).params
    )
    params = jax.tree.map(jax.numpy.asarray, params)
    opt_state, stale = tx.init(params), params
    grad_fn = jax.jit(lambda p, b: averaged_grads(trainer.model, p, b)[:2])
    batches = build_data(cfg.data, cfg.model.vocab_size, cfg.seed).train_iter()
    ref_losses = []
    for _ in range(cfg.steps):
        loss, grads = grad_fn(stale, jax.numpy.asarray(next(batches)))
        ref_losses.append(float(loss))
        updates, opt_state = tx.update(grads, opt_state, params)
        stale, params = params, jax.tree.map(lambda p, u: p + u, params, updates)
    param_tol, loss_tol = TOLERANCE["float32"]
    np.testing.assert_allclose(losses, ref_losses, atol=loss_tol, rtol=0)
    assert losses[1] == losses[0] or abs(losses[1] - ref_losses[1]) < loss_tol  # step 2 still at w_0
    for a, b in zip(jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(jax.device_get(params))):
        assert rel(a, b) < param_tol


TWO_PASS_CASES = [
    ("zero-offload", "float32", {}),
    ("zero3-offload", "float32", {}),
    ("partial", "float32", {}),  # a resident block: its weights through the pinned staging buffers
    ("zero3-offload-bf16-moments", "float32", {}),
    ("zero3-offload", "bfloat16", {"data.grad_accum": "1"}),  # bf16 block gradients
]


@pytest.mark.parametrize("mode, dtype, over", TWO_PASS_CASES)
def test_two_pass_updates_train_bitwise_like_one_pass(mode, dtype, over):
    """Two-pass updates (the weights first, masters and state a step later) change when the host
    does the work, not what it computes: the same losses and the same final masters and moments,
    bit for bit, as one-pass updates, whether every unit, the first two or an adaptive count."""
    runs = {
        k: run(tiny("llama", dtype, **MODES[mode], **over, **{"offload.two_pass_units": k}), guard=True)
        for k in ("0", "-1", "2")
    }
    _, one_state, one_losses, one_norms, one_val = runs["0"]
    assert (one_norms > 0.5).all(), "clipping must be active: two-pass updates apply only then"
    assert runs["0"][0].timings(1.0, 1)["two_pass_units"] == 0
    for k in ("-1", "2"):
        trainer, state, losses, norms, val = runs[k]
        two_passed = trainer.timings(1.0, 1)["two_pass_units"]  # updates done in two passes, all steps
        assert two_passed == 2 * STEPS if k == "2" else two_passed > STEPS, two_passed
        np.testing.assert_array_equal(losses, one_losses)
        np.testing.assert_array_equal(norms, one_norms)
        assert val == one_val
        for a, b in zip(jax.tree.leaves(state.resolved()[:2]), jax.tree.leaves(one_state.resolved()[:2])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_pinned_pool_reservation_runs_before_the_first_pinned_array(monkeypatch):
    """The start-up growth of the pinned pool (a GPU-only measure, `memory.pinned_pool_reservation`)
    runs once, ahead of the state's pinned arrays, and leaves nothing allocated behind."""
    from jaxzero.offload import build_offload_trainer

    cfg = tiny("llama", "float32", **MODES["zero3-offload"])
    mesh = placement.make_mesh(jax.devices()[:1])
    puts = []
    real_put = jax.device_put

    def put(x, device=None, *a, **k):
        if getattr(device, "memory_kind", None) == "pinned_host":
            puts.append(getattr(x, "nbytes", 0))
        return real_put(x, device, *a, **k)

    monkeypatch.setattr(jax, "device_put", put)
    reserve = 3 << 20
    trainer = build_offload_trainer(cfg, mesh, pinned_reserve=reserve)
    state = trainer.init(jax.random.key(0))
    assert puts[0] == reserve and puts.count(reserve) == 1
    assert not [a for a in jax.live_arrays() if a.nbytes == reserve]  # freed at once
    data = build_data(cfg.data, cfg.model.vocab_size, cfg.seed).train_iter()
    state, m = trainer.step(state, trainer.put_batch(next(data)))
    assert np.isfinite(float(m.loss))
    # Restoring a checkpoint into a new trainer: the same, before the restored state's pinned arrays.
    saved = trainer.saved_state(state)
    puts.clear()
    restored = build_offload_trainer(cfg, mesh, pinned_reserve=reserve).from_saved_state(saved)
    assert puts[0] == reserve and puts.count(reserve) == 1
    jax.block_until_ready(restored)


def test_each_step_reads_its_norm_on_the_host_once(monkeypatch):
    """The unit tasks share one read of the step's norm (`HostScalar`), however many units wait."""
    from jaxzero.offload import host_memory

    scalar_reads = []
    real_view = host_memory.host_view

    def counting_view(x):
        if np.ndim(x) == 0:
            scalar_reads.append(x)
        return real_view(x)

    monkeypatch.setattr(host_memory, "host_view", counting_view)
    cfg = tiny("llama", "float32", **MODES["zero3-offload"])  # clipping on: every unit needs the norm
    run(cfg)
    assert len(scalar_reads) == STEPS  # one per step, not one per unit (5 units here)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_head_loss_in_pieces_is_the_same_function(references, monkeypatch, dtype):
    """Where a micro-batch's logits would pass `objective.HEAD_LOGITS_BYTES`, the loss runs over equal
    pieces of each sequence (one piece's logits at a time, remade in the backward pass). Lowered
    here so that the tiny model's sequences run in 4 pieces: the resident and the offload trainer
    train as the unpieced reference does, within the module's tolerances."""
    from jaxzero.numerics import objective

    monkeypatch.setattr(objective, "HEAD_LOGITS_BYTES", 4 * 8 * 256 * 8)
    cfg = tiny("llama", dtype, **MODES["zero3-offload"])
    micro_rows = cfg.data.batch_size // cfg.data.grad_accum
    assert objective.head_pieces(micro_rows, cfg.data.seq_len, cfg.model.vocab_size) == 4
    _, ref_state, ref_losses, ref_norms, ref_val = references("llama", dtype)
    param_tol, loss_tol = TOLERANCE[dtype]
    for over in (MODES["zero3-offload"], {"offload.optimizer": "none", "offload.params": "none"}):
        _, state, losses, norms, val = run(tiny("llama", dtype, **over))
        np.testing.assert_allclose(losses, ref_losses, atol=loss_tol, rtol=0)
        np.testing.assert_allclose(norms, ref_norms, rtol=param_tol)
        assert abs(val - ref_val) < loss_tol
        for a, b in zip(jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(ref_state.params)):
            assert rel(a, b) < param_tol

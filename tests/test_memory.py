"""Memory planning and the early, clear failures it gives (before anything is allocated)."""

import os

import jax
import pytest

from jaxzero.config import ConfigError, TrainConfig
from jaxzero.models.sizes import param_count, unit_param_counts
from jaxzero.overrides import apply_overrides
from jaxzero.planner import memory, runtime
from jaxzero.planner.calibration import SAVE_WORKING_BYTES

GiB = 2**30
RESIDENT = {"offload.optimizer": "none", "offload.params": "none"}


def cfg(**over) -> TrainConfig:
    """Explicit placements (resident unless `over` says otherwise): what `plan_memory` counts."""
    base = {"model.name": "llama-7b", "data.seq_len": "2048", "data.batch_size": "8", **RESIDENT}
    return apply_overrides(TrainConfig(), {**base, **{k.replace("__", "."): v for k, v in over.items()}})


def test_plan_counts_bytes_per_parameter():
    n = param_count(cfg().model)
    e, b, h = unit_param_counts(cfg().model)
    assert e + 32 * b + h == n
    resident = memory.plan_memory(cfg(checkpoint__enabled="false"))
    # masters 4 + AdamW 8 + gradients 2 (one micro-batch: the compute dtype, cast as they are used)
    assert resident.host == 0 and resident.accelerator_state == 14 * n
    accum = memory.plan_memory(cfg(checkpoint__enabled="false", data__grad_accum="2"))
    assert accum.accelerator_state == 16 * n  # float32 sums over several micro-batches
    # A save (asynchronous or not) or a restore: the checkpoint buffer and one unit's masters + AdamW.
    buffer, unit = 2 * GiB + SAVE_WORKING_BYTES, 12 * max(e, b, h)
    assert memory.plan_memory(cfg()).host == buffer + unit
    assert memory.plan_memory(cfg(checkpoint__async_save="false")).host == buffer + unit
    assert memory.plan_memory(cfg(checkpoint__buffer_gib="0.5")).host == buffer - 3 * GiB // 2 + unit
    zero = memory.plan_memory(cfg(offload__optimizer="cpu", offload__two_pass_units="0"))
    # Gradients: blocks' in bf16 (one micro-batch), embedding's and head's float32 sums; and the new
    # weights' staging.
    grads = 2 * 32 * b + 4 * (e + h)
    assert zero.pinned == grads + 2 * n
    # Two-pass updates keep a unit's gradients into the next step: up to every unit's (adaptive,
    # the default), the first K units' (embedding, K - 1 blocks), none without clipping.
    two_pass = memory.plan_memory(cfg(offload__optimizer="cpu"))
    assert two_pass.pinned == zero.pinned + grads
    k5 = memory.plan_memory(cfg(offload__optimizer="cpu", offload__two_pass_units="5"))
    assert k5.pinned == zero.pinned + 4 * e + 2 * 4 * b
    unclipped = memory.plan_memory(cfg(offload__optimizer="cpu", optimizer__grad_clip="0"))
    assert unclipped.pinned == zero.pinned
    assert zero.accelerator_state == 2 * n  # bf16 weights resident
    full = memory.plan_memory(
        cfg(offload__optimizer="cpu", offload__params="cpu", offload__two_pass_units="0")
    )
    assert full.pinned == grads + 2 * 32 * b + 2 * (e + h)  # gradients, streamed weights, staging
    assert full.accelerator_state < 0.15 * zero.accelerator_state  # embed/head + 3 blocks in flight
    accum = memory.plan_memory(
        cfg(offload__optimizer="cpu", data__grad_accum="2", offload__two_pass_units="0")
    )
    assert accum.pinned == 4 * n + 2 * n  # float32 gradient sums leave with several micro-batches
    # The delayed update keeps a second copy of the compute weights, wherever they live.
    delayed = memory.plan_memory(
        cfg(offload__optimizer="cpu", offload__params="cpu", offload__update="delayed")
    )
    # ... and two steps' gradients (bf16 block sums, float32 embed and head: the next pass's land
    # while the host still updates from the previous ones).
    assert delayed.pinned == full.pinned + 2 * 32 * b + (32 * b * 2 + (e + h) * 4)
    delayed = memory.plan_memory(cfg(offload__optimizer="cpu", offload__update="delayed"))
    assert delayed.accelerator_state == 2 * zero.accelerator_state


def test_units_with_state_on_the_accelerator_move_their_bytes_there():
    """The first K units' masters (4), AdamW state (8) and gradients (blocks' bf16, embedding's
    float32) count on the accelerator, with one bf16 cast of the largest of them (the passes read the
    masters), and none of theirs on the host or pinned."""
    e, b, h = unit_param_counts(cfg().model)
    base = dict(offload__optimizer="cpu", offload__params="cpu", offload__two_pass_units="0")
    host_only = memory.plan_memory(cfg(**base, checkpoint__enabled="false"))
    mixed = memory.plan_memory(cfg(**base, offload__device_state_units="3", checkpoint__enabled="false"))
    on_device = (4 + 8 + 4) * e + 2 * (4 + 8 + 2) * b + 2 * max(e, b)  # the embedding and blocks 0-1
    # They left the pinned memory (gradients and staged or streamed weights) and the host state...
    assert host_only.pinned - mixed.pinned == (4 + 2) * e + 2 * (2 + 2) * b
    pool = memory.pinned_pool_bytes
    assert host_only.host - mixed.host == (4 + 8) * (e + 2 * b) + pool(host_only.pinned) - pool(mixed.pinned)
    # ... for the accelerator (which no longer holds the embedding's bf16 weights as a host unit's).
    assert mixed.accelerator_state - host_only.accelerator_state == on_device - 2 * e
    # With checkpoints, in either mode, a save or a restore adds the buffer and one unit, whatever
    # the model's size: arrays are written from where they live, no copy of the state.
    for mode in ("true", "false"):
        saving = dict(**base, offload__device_state_units="3", checkpoint__async_save=mode)
        assert memory.plan_memory(cfg(**saving)).host - mixed.host == 2 * GiB + SAVE_WORKING_BYTES + 12 * max(
            e, b, h
        )


def test_block_inputs_in_pinned_host_leave_three_on_the_accelerator():
    base = dict(offload__optimizer="cpu", offload__params="cpu", data__batch_size="4", data__seq_len="4096")
    kept = memory.plan_memory(cfg(**base))
    away = memory.plan_memory(cfg(**base, offload__activations="cpu"))
    block_input = 4 * 4096 * cfg().model.hidden_size * 2  # tokens x hidden x bf16
    assert kept.activations - away.activations == (32 - 3) * block_input
    assert away.pinned - kept.pinned == 31 * block_input  # all but the last block's
    pool = memory.pinned_pool_bytes
    assert away.host - kept.host == pool(away.pinned) - pool(kept.pinned)


def test_host_too_small_is_refused_with_numbers():
    c = cfg(offload__optimizer="cpu", offload__params="cpu")
    plan = memory.plan_memory(c)
    with pytest.raises(
        ConfigError,
        match=r"needs \d+\.\d GiB of host RAM .* but 64\.0 GiB .* offload.two_pass_units=0 .* "
        r"checkpoint.buffer_gib",
    ):
        memory.check_host_fits(c, plan, available=64 * GiB)
    memory.check_host_fits(c, plan, available=plan.host + 1)


def test_accelerator_too_small_is_refused_with_a_hint():
    c = cfg()
    with pytest.raises(ConfigError, match="needs 87.9 GiB of accelerator memory .*optimizer=cpu keeps"):
        memory.check_accelerator_fits(c, memory.plan_memory(c), capacity=80 * GiB)
    c2 = cfg(offload__optimizer="cpu")
    with pytest.raises(ConfigError, match="offload.params=cpu streams the weights"):
        memory.check_accelerator_fits(c2, memory.plan_memory(c2), capacity=10 * GiB)
    c3 = cfg(offload__optimizer="cpu", offload__params="cpu")
    warning = memory.check_accelerator_fits(c3, memory.plan_memory(c3), capacity=10 * GiB)
    assert warning and "lower data.batch_size" in warning


def test_pinned_pool_is_sized_or_the_user_is_told(monkeypatch):
    big = memory.MemoryPlan(host=0, pinned=100 * 10**9, accelerator_state=0, activations=0)
    small = memory.MemoryPlan(host=0, pinned=10 * 10**9, accelerator_state=0, activations=0)
    monkeypatch.setenv(runtime.PINNED_POOL_ENV, "0")  # so that teardown unsets what the test sets
    monkeypatch.delenv(runtime.PINNED_POOL_ENV)
    jax.devices()  # the backend is running, as it is in any session that already used JAX
    assert runtime.configure_pinned_pool(small) == runtime.PINNED_POOL_DEFAULT_GB
    # Raising the cap after the backend started is impossible: the error says what to set.
    with pytest.raises(ConfigError, match=r"needs 112 GB of pinned host memory.*_MEMORY_LIMIT_GB=112 in"):
        runtime.configure_pinned_pool(big)
    monkeypatch.setenv(runtime.PINNED_POOL_ENV, "80")
    with pytest.raises(ConfigError, match="XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=80 is below the 112 GB"):
        runtime.configure_pinned_pool(big)
    monkeypatch.setenv(runtime.PINNED_POOL_ENV, "120")
    assert runtime.configure_pinned_pool(big) == 120


def test_the_pinned_pool_is_grown_at_start_on_gpus_only():
    c = cfg(offload__optimizer="cpu", offload__params="cpu")
    plan = memory.plan_memory(c)
    # 2% over the arrays: the region it makes holds them with the allocator's fragmentation
    assert plan.pinned > 0 and memory.pinned_pool_reservation(plan, "gpu") == int(plan.pinned * 1.02)
    assert memory.pinned_pool_reservation(plan, "cpu") == 0  # no pool: plain host memory
    assert memory.pinned_pool_reservation(plan, "tpu") == 0  # not XLA's GPU pool


def test_pinned_pool_is_capped_at_the_plan_when_jaxzero_starts_the_backend(monkeypatch):
    """Before JAX starts, the cap is set to the run's pool (plan + 25% + 2 GB) even under XLA's 64 GB
    default, so that the pool's doubling regions cannot hold more than the plan allows."""
    plan = memory.MemoryPlan(host=0, pinned=20 * 10**9, accelerator_state=0, activations=0)
    monkeypatch.setattr(runtime, "backends_started", lambda: False)
    monkeypatch.setattr(runtime, "_pool_set_here", {})
    monkeypatch.setenv(runtime.PINNED_POOL_ENV, "0")  # so that teardown unsets what the test sets
    monkeypatch.delenv(runtime.PINNED_POOL_ENV)
    assert runtime.configure_pinned_pool(plan) == 27  # 1.25 x 20 + 2 (the minimum is 1.1 x 20 + 2 = 24)
    assert os.environ[runtime.PINNED_POOL_ENV] == "27"
    # A second, larger run in the same process meets the pool sized for the first: it is told so.
    big = memory.MemoryPlan(host=0, pinned=40 * 10**9, accelerator_state=0, activations=0)
    with pytest.raises(ConfigError, match=r"sized to 27 GB for an earlier run.*in a new process"):
        runtime.configure_pinned_pool(big)
    assert runtime.configure_pinned_pool(plan) == 27  # one that fits uses it
    monkeypatch.setenv(runtime.PINNED_POOL_ENV, "40")  # a user's cap that is enough stands
    assert runtime.configure_pinned_pool(plan) == 40


def test_bf16_moments_cut_host_state_from_12_to_8_bytes_per_parameter():
    n = param_count(cfg().model)
    over = {"offload__optimizer": "cpu", "checkpoint__enabled": "false"}
    full = memory.plan_memory(cfg(**over))
    half = memory.plan_memory(cfg(**over, optimizer__state_dtype="bfloat16"))
    assert full.host - half.host == 4 * n  # masters 4 + moments 8 -> masters 4 + moments 4


def test_zero_stages_divide_the_plan_per_device_and_per_process():
    """Resident: stage 3 splits every state byte over the devices, stage 0 none. Offloaded: each of
    2 processes holds half the host state; each device half the activations."""
    base = {"model.name": "llama-1b", "data.batch_size": "8", "checkpoint.async_save": "false", **RESIDENT}

    def plan(devices, processes, **over):
        cfg = apply_overrides(TrainConfig(), {**base, **over})
        return memory.plan_memory(cfg, devices=devices, processes=processes)

    whole = plan(1, 1).accelerator_state
    assert plan(4, 1, **{"parallel.zero_stage": "0"}).accelerator_state == whole
    assert plan(4, 1, **{"parallel.zero_stage": "3"}).accelerator_state == pytest.approx(whole / 4, rel=1e-6)
    offload = {"offload.optimizer": "cpu", "offload.params": "cpu"}
    one, two = plan(1, 1, **offload), plan(2, 2, **offload)
    # the pool is by regions; a checkpoint's buffer is per process, whatever its share
    state = lambda p: p.host - memory.pinned_pool_bytes(p.pinned) - 2 * GiB - SAVE_WORKING_BYTES  # noqa: E731
    assert state(two) == pytest.approx(state(one) / 2, rel=1e-6)
    assert two.pinned == pytest.approx(one.pinned / 2, rel=1e-6)
    assert two.activations < one.activations


def test_processes_on_one_host_share_its_ram():
    """Two processes of a run on one host each need their plan's host bytes: each may count on half
    of what is available."""
    c = cfg(offload__optimizer="cpu", offload__params="cpu")
    plan = memory.plan_memory(c)
    memory.check_host_fits(c, plan, available=2 * plan.host + 2, sharing=2)
    with pytest.raises(ConfigError, match="to each of the 2 processes on this host"):
        memory.check_host_fits(c, plan, available=2 * plan.host - 2, sharing=2)


def test_arrays_no_stage_can_split_are_counted_whole():
    """llama-7b on 6 devices: no first axis (4096, 11008, 32000) divides by 6, so every array stays
    whole on every device, and the plan counts it so; on 4 devices they all split."""
    from jaxzero.models import build_model
    from jaxzero.plan import placement

    c = cfg(parallel__zero_stage="3", checkpoint__async_save="false")
    shapes = jax.eval_shape(build_model(c.model).init, jax.random.key(0))
    assert placement.whole_params(shapes, 6) == unit_param_counts(c.model)
    assert placement.whole_params(shapes, 4) == (0, 0, 0)
    whole = memory.plan_memory(c, devices=6, processes=1, whole=placement.whole_params(shapes, 6))
    assert whole.accelerator_state == memory.plan_memory(c).accelerator_state  # nothing split
    split = memory.plan_memory(c, devices=4, processes=1, whole=placement.whole_params(shapes, 4))
    assert split.accelerator_state == pytest.approx(whole.accelerator_state / 4, rel=1e-6)


def test_the_pinned_pool_takes_what_xlas_regions_make_of_the_reservation():
    """XLA's BFC pool grows by one region a request, 2 MiB doubled until it holds it, clipped by what
    the cap leaves: the host RAM the pool takes is that region (or the cap), not the pinned bytes."""
    pool = memory.pinned_pool_bytes
    assert pool(0) == 0
    assert pool(14 * GiB, cap=64 * GiB) == 16 * GiB  # 14.3 GiB reserved: a 16 GiB region
    assert pool(int(15.9 * GiB), cap=64 * GiB) == 32 * GiB  # 16.2 GiB reserved: the next power of two
    assert pool(20 * GiB, cap=29 * GiB) == 29 * GiB  # a 32 GiB region clipped by the cap
    # jaxzero's own cap for the run (25% and 2 GB over its pinned bytes) clips it by default
    assert pool(20 * GiB) == memory.pinned_pool_cap_gb(20 * GiB) * GiB == 29 * GiB
    # one region per local device, each for its share
    assert pool(20 * GiB, local_devices=2, cap=64 * GiB) == 2 * 16 * GiB
    # Arrays that fill more than 90% of their region grow a second as large, as far as the cap lets
    # (a 32 GiB region filled to 96% by the plan's count grew one on an H200: BENCHMARKS.md).
    assert pool(int(14.5 * GiB), cap=64 * GiB) == 2 * 16 * GiB
    assert pool(int(29.3 * GiB), cap=37 * GiB) == 37 * GiB
    assert pool(int(29.3 * GiB)) == memory.pinned_pool_cap_gb(int(29.3 * GiB)) * GiB  # jaxzero's cap


def test_activations_are_the_saved_inputs_and_the_larger_phase():
    """The head's phase (float32 logits and their gradient) and a block's backward never overlap:
    the estimate holds the larger beside the saved block inputs. A resident run's gradients replace
    the saved inputs as its backward frees them, so its peak is the larger of the two."""
    c = cfg(offload__optimizer="cpu", offload__params="cpu", data__batch_size="16")
    m, tokens = c.model, 16 * 2048
    t = memory.transient_activations(m, tokens)
    assert t.head == tokens * (2 * 4 * m.vocab_size + 2 * m.hidden_size)
    assert t.block == tokens * 2 * (2 * 3 * m.hidden_size + 2 * m.hidden_size + 4 * m.intermediate_size)
    e, b, h = unit_param_counts(m)
    saved = 32 * tokens * m.hidden_size * 2
    assert memory.plan_memory(c).activations == saved + max(t.block, t.head + 4 * h)
    # grouped-query attention: k and v are narrower (llama-20b: 8 of 48 heads)
    big = cfg(model__name="llama-20b").model
    kv = big.hidden_size * big.num_kv_heads // big.num_heads
    widths = 2 * (big.hidden_size + 2 * kv) + 2 * big.hidden_size + 4 * big.intermediate_size
    assert memory.transient_activations(big, 1).block == widths * 2
    # its 32K-token micro-batch of 2048-token sequences runs the head loss in 4 pieces, with the
    # output projection and the sum of its gradient in float32
    pieced = memory.transient_activations(big, 16 * 2048, 2048)
    v, d = big.vocab_size, big.hidden_size
    assert pieced.head == 4 * 2048 * 2 * 4 * v + 16 * 2048 * d * 2 + 2 * 4 * v * d
    n = param_count(m)
    resident = memory.plan_memory(cfg(data__batch_size="16", checkpoint__enabled="false"))
    assert resident.accelerator_state + resident.activations == 12 * n + max(saved + t.head, 2 * n + t.block)


def test_gradients_of_units_updated_on_the_accelerator_replace_the_block_inputs():
    """Those units come first in the forward order, so the backward pass writes their gradients last,
    as it frees the block inputs: the peak is every block input with the head's phase, or those
    gradients with the last block's backward, whichever is larger (one micro-batch; several sum their
    gradients beside the activations throughout)."""
    base = dict(offload__optimizer="cpu", offload__params="cpu", data__batch_size="16")
    e, b, h = unit_param_counts(cfg().model)
    m, tokens = cfg().model, 16 * 2048
    t = memory.transient_activations(m, tokens)
    none = memory.plan_memory(cfg(**base, checkpoint__enabled="false"))
    k = memory.plan_memory(cfg(**base, offload__device_state_units="20", checkpoint__enabled="false"))
    grads = 4 * e + 2 * 19 * b  # the embedding's float32, 19 blocks' bf16
    assert k.activations == max(none.activations - grads, t.block)
    accum = dict(base, data__grad_accum="2", checkpoint__enabled="false")
    assert (
        memory.plan_memory(cfg(**accum, offload__device_state_units="20")).activations
        == memory.plan_memory(cfg(**accum)).activations
    )


def test_a_block_backward_larger_than_the_heads_hole_is_counted_beside_the_head_phase():
    """The head's outputs (the gradient it returns, its float32 weight gradient) lie past its
    temporaries, so the space those leave is a hole; a block backward's temporaries, needed in one
    piece, go past the outputs when they do not fit it. Short sequences: the head's phase is the
    larger and the peak is the larger phase; one long sequence: both phases at once (llama-7b at
    188,416 tokens ran out of memory on an H100 with the larger phase alone planned)."""
    assert memory.backward_phases(memory.Transient(block=10, head=12, head_out=3)) == 12 + 10
    assert memory.backward_phases(memory.Transient(block=9, head=12, head_out=3), head_grad=2) == 14
    # llama-7b: at 32K tokens in 2,048-token sequences the block backward fits the hole; at one
    # sequence of 188,416 tokens it does not, and the plan counts both phases.
    m = cfg().model
    short = memory.transient_activations(m, 16 * 2048, 2048)
    assert short.block <= short.head - short.head_out
    long = memory.transient_activations(m, 188416, 188416)
    assert long.block > long.head - long.head_out
    base = dict(offload__optimizer="cpu", offload__params="cpu", data__batch_size="1", data__seq_len="188416")
    c = cfg(**base, model__max_seq_len="188416")
    e, b, h = unit_param_counts(c.model)
    saved = 32 * 188416 * m.hidden_size * 2
    assert memory.plan_memory(c).activations == saved + long.head + 4 * h + long.block


def test_block_inputs_in_pinned_host_leave_no_room_for_the_accelerators_late_gradients():
    """With the block inputs in pinned memory the backward frees almost nothing on the accelerator,
    so the gradients of the units it updates count in full (an H100 run at 155,648 tokens measured
    8 GiB over a plan that let them replace the block inputs)."""
    base = dict(offload__optimizer="cpu", offload__params="cpu", data__batch_size="4", data__seq_len="4096")
    base.update(offload__activations="cpu", checkpoint__enabled="false")
    none = memory.plan_memory(cfg(**base))
    k = memory.plan_memory(cfg(**base, offload__device_state_units="20"))
    assert k.activations == none.activations


def test_the_largest_fitting_model_keeps_as_many_units_on_the_accelerator_as_it_has():
    """A refusal's "largest named model that fits" re-plans smaller models with the run's settings: a
    count of units with state on the accelerator larger than a smaller model has is cut to its units
    (it once indexed past them)."""
    cfg = apply_overrides(
        TrainConfig(),
        {
            "model.name": "llama-13b",
            "offload.optimizer": "cpu",
            "offload.params": "cpu",
            "offload.device_state_units": "17",
        },
    )
    # Qwen3 4B (4.02B parameters) is the largest named size under the bound, ahead of llama-3.4b-bench.
    assert memory.largest_fitting(cfg, lambda need: need.accelerator_state < 40 * 2**30) == "qwen3-4b"


def test_checkpoint_saves_are_counted_without_a_loop_over_the_steps():
    """Every `checkpoint.every`-th step and the last, from `first` on: the same as counting step by step,
    and at once for a huge `steps` (the count looped over every step before training: minutes at 100%
    CPU for --steps=10**20, deaf to SIGTERM)."""
    from jaxzero.planner.memory import checkpoint_saves

    cases = [(10, 0, 1), (10, 3, 1), (9, 3, 1), (9, 3, 4), (9, 3, 10), (12, 4, 5), (7, 1, 3)]
    for steps, every, first in cases:
        cfg = apply_overrides(TrainConfig(), {"steps": str(steps), "checkpoint.every": str(every)})
        due = sum(step == steps or bool(every and step % every == 0) for step in range(first, steps + 1))
        assert checkpoint_saves(cfg, first) == due, (steps, every, first)
    huge = apply_overrides(TrainConfig(), {"steps": str(2**31 - 1), "checkpoint.every": "1000"})
    assert checkpoint_saves(huge) == (2**31 - 1) // 1000 + 1
    off = apply_overrides(TrainConfig(), {"checkpoint.enabled": "false"})
    assert checkpoint_saves(off) == 0

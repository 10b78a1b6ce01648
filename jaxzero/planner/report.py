"""What the planner decided, for a person: the `Decision` with its table (`python -m jaxzero.plan`,
`logging.plan=full`) and its one-line summary, and the text of a refusal when nothing fits. A run with
a frozen part (LoRA, `finetune.freeze`) is told in its own words: what trains, and where its base is.

Nothing here decides: `jaxzero.planner.search` chooses, and hands this module what it found.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from jaxzero.config import IN_FLIGHT_MAX, TrainConfig, buffer_bytes, in_flight_bytes
from jaxzero.models.sizes import NAMED_SIZES, inactive_expert_params, param_count, unit_param_counts
from jaxzero.plan import OffloadPlan, Tier, UnitKind, UnitPlan
from jaxzero.planner import memory, partial, runtime
from jaxzero.planner.calibration import (
    CHECKPOINT_WRITE_BPS,
    GB,
    GPU_HEADROOM,
    HOST_HEADROOM,
    SAVE_COST_WARNING,
    GiB,
)
from jaxzero.planner.candidates import Candidate
from jaxzero.planner.cost import Prediction
from jaxzero.planner.machine import Machine
from jaxzero.planner.memory import MemoryPlan


@dataclass(frozen=True, kw_only=True)
class Decision:
    """Where this run's state lives, why, and how fast it is predicted to be."""

    config: TrainConfig  # the user's config with every auto key decided
    plan: OffloadPlan  # `resolve_plan(config)`
    memory: MemoryPlan  # `memory.plan_memory` of it on `machine`
    prediction: Prediction  # the step predicted, with its parts
    machine: Machine  # what was planned for
    decided: tuple[str, ...]  # "offload.key=value" of each key the planner set
    warning: str | None = None  # an explicit placement whose activations may not fit

    @property
    def step_s(self) -> float:
        """Predicted seconds per optimizer step."""
        return self.prediction.step_s

    @property
    def bottleneck(self) -> str:
        return self.prediction.bottleneck

    # A placement is obvious (a one-line plan at start) when everything stays on the devices and
    # fills at most this share of each memory: a person reading it has nothing to decide.
    OBVIOUS_FILL = 0.5

    def obvious(self) -> bool:
        """Whether one line says it all: resident state (a frozen base too), no warning, every memory
        at most half full."""
        if self.plan.host_update is not None or self.memory.pinned or self.warning or self.memory.disk:
            return False
        fills = [self._ram_needed() / self.machine.host_usable]
        if self.machine.gpu_bytes is not None:
            fills.append(self._gpu_needed() / self.machine.gpu_usable)
        return max(fills) <= self.OBVIOUS_FILL

    def _ram_needed(self) -> int:
        """Host RAM of one process (`memory.host_ram_need`): on a GPU, the host state and the process;
        on a CPU backend, the host and device state with their allowances and the activations."""
        return memory.host_ram_need(self.memory, cpu_backend=self.machine.gpu_bytes is None)

    def _gpu_needed(self) -> int:
        """Accelerator memory per device: the state kept there and the activations."""
        return self.memory.accelerator_state + self.memory.activations

    def checkpoint_bytes(self) -> int:
        """Bytes of one checkpoint: the float32 masters and the optimizer state (of a run with a
        frozen part, of what trains: the base is rebuilt from the config)."""
        if self.config.finetune.partial:
            return partial.checkpoint_bytes(self.config)
        return param_count(self.config.model) * (4 + memory.optimizer_state_bytes(self.config))

    def checkpoint_disk(self) -> tuple[int, int]:
        """(bytes, count) of the checkpoints on disk at once at most: `checkpoint.keep` and the one
        being written, as many as the run saves (`memory.checkpoints_on_disk`); (0, 0) without
        checkpoints."""
        cfg = self.config
        count = memory.checkpoints_on_disk(cfg.checkpoint, 0, memory.checkpoint_saves(cfg))
        return count * self.checkpoint_bytes(), count

    def checkpoint_shortfall(self) -> str | None:
        """Why the run's checkpoints cannot fit the free disk under its run directory (the check
        `python -m jaxzero.train` makes at start), or None; None also for a machine described by
        `machine.gpu_gib` without `machine.disk_gib` (this machine's disk says nothing of it)."""
        need, count = self.checkpoint_disk()
        free, mc = self.machine.run_dir_bytes, self.config.machine
        # A machine described by machine.gpu_gib is not this one: its disk is known only if given.
        if need <= free or (mc.gpu_gib and not mc.disk_gib):
            return None
        return (
            f"the run's checkpoints need {gib(need)} of disk under run_dir at once ({count} of "
            f"{gib(need // count)}: the newest checkpoint.keep={self.config.checkpoint.keep} and the one "
            f"being written, as many as the run saves), and {gib(free)} is free there: train refuses it. "
            "Pass a --run_dir on a larger disk, a lower checkpoint.keep, or checkpoint.enabled=false."
        )

    def save_seconds(self) -> float:
        """Seconds one checkpoint takes to write: this host's processes' share of the masters and
        optimizer state at the writer's rate (`CHECKPOINT_WRITE_BPS`)."""
        mc = self.machine
        return self.checkpoint_bytes() * mc.local_processes / mc.processes / CHECKPOINT_WRITE_BPS

    def save_warning(self) -> str | None:
        """A warning where saves every `checkpoint.every` steps may block training for more than
        `SAVE_COST_WARNING` of the run: a step waits for the writer at each unit it has not written
        yet and the buffer does not hold, so a save may block training for up to its whole writing
        time, less what the buffer copies instead (`_copyable_bytes`, as much as it has room for).
        Names the interval that keeps the cost under that share, and the buffer that holds a copy of
        every unit it can copy where the plan leaves the RAM for it (`_buffer_advice`)."""
        ck = self.config.checkpoint
        if not ck.enabled or ck.every <= 0:
            return None
        state, copyable = self.checkpoint_bytes() // self.machine.processes, self._copyable_bytes()
        waited = state - min(copyable, buffer_bytes(ck) - in_flight_bytes(ck))
        save_s, between_s = self.save_seconds(), ck.every * self.step_s
        wait_s = save_s * waited / max(state, 1)
        if wait_s <= SAVE_COST_WARNING * (between_s + wait_s):
            return None
        every = math.ceil(wait_s * (1 - SAVE_COST_WARNING) / SAVE_COST_WARNING / self.step_s)
        return (
            f"warning: a save every {ck.every} steps writes for ~{save_s:.3g} s (at ~"
            f"{CHECKPOINT_WRITE_BPS / GB:.2g} GB/s), while {ck.every} steps take ~{between_s:.3g} s: "
            f"training may wait up to ~{wait_s:.3g} s per save, up to "
            f"{wait_s / (between_s + wait_s):.0%} of the run. checkpoint.every={every} or more keeps it "
            f"under {SAVE_COST_WARNING:.0%}; {self._buffer_advice(copyable, state - copyable)}"
        )

    def _copyable_bytes(self) -> int:
        """Bytes this process's save writes of the units whose masters and state are in host RAM or
        on disk: those a save copies into its buffer ahead of their next update, where it has room.
        A unit whose state the accelerator holds waits for the writer, and so does a run with a
        frozen part (its step updates what trains at once)."""
        if self.config.finetune.partial:
            return 0
        params = UnitKind.keyed(unit_param_counts(self.config.model))
        host = sum(params[u.kind] for u in self.plan.units if u.state is not Tier.DEVICE)
        return self.checkpoint_bytes() * host // param_count(self.config.model) // self.machine.processes

    def _buffer_advice(self, copyable: int, on_device: int) -> str:
        """The `checkpoint.buffer_gib` that holds a copy of the `copyable` bytes beside what a save
        keeps in flight, where the RAM the plan leaves free holds the difference; else how much is
        free for a larger one (the 3.37B preset's saves held training 1.4 s with a buffer of its
        state against 20.6 s: BENCHMARKS.md, "Checkpoints in bounded host RAM (issue 26)").
        `on_device`: the bytes of units whose updates wait whatever the buffer."""
        ck = self.config.checkpoint
        free = max(0, self.machine.host_usable - self._ram_needed())
        need = math.ceil((copyable + IN_FLIGHT_MAX) / GiB)
        device = f"; the {gib(on_device)} of state the accelerator holds is waited for" if on_device else ""
        if copyable and need > ck.buffer_gib and (need - ck.buffer_gib) * GiB <= free:
            return (
                f"checkpoint.buffer_gib={need} (now {ck.buffer_gib:g}; the plan leaves {gib(free)} of "
                f"RAM free) holds a copy of every unit whose state is in host RAM or on disk, so "
                f"training copies them instead of waiting{device}."
            )
        if copyable and need > ck.buffer_gib:
            return (
                f"a larger checkpoint.buffer_gib (now {ck.buffer_gib:g}; the plan leaves {gib(free)} of "
                f"RAM free) lets training copy more units and wait less{device}."
            )
        return (
            f"the {gib(on_device)} of state the accelerator holds is written before its updates go on, "
            "whatever checkpoint.buffer_gib is."
        )

    def line(self) -> str:
        """The plan in one line: placement, the fullest memory, the predicted step."""
        word = _device_word(self.machine)
        chosen = f"decided {', '.join(self.decided)}" if self.decided else "as configured"
        if self.config.finetune.partial:
            return (
                f"plan: {_frozen_part_words(self.config)} ({chosen}); {gib(self._gpu_needed())} "
                f"of {gib(self.machine.gpu_usable or self.machine.host_usable)} device memory; predicted "
                f"{self.step_s:.3g} s per step, bound by {self.bottleneck}"
            )
        memories = [f"{gib(self._ram_needed())} of {gib(self.machine.host_usable)} RAM"]
        if self.machine.gpu_bytes is not None:
            memories.insert(0, f"{gib(self._gpu_needed())} of {gib(self.machine.gpu_usable)} {word} memory")
        return (
            f"plan: {self.plan.mode} ({chosen}); {', '.join(memories)}; predicted "
            f"{self.step_s:.3g} s per step, bound by {_in_words(self.bottleneck, word)}"
        )

    def table(self) -> str:
        """What the planner chose and why, for a person: the units by tier, memory against capacity,
        the predicted step and its bottleneck, and the machine's figures with their sources."""
        if self.config.finetune.partial:
            return _frozen_part_table(self)
        cfg, mc, need, p = self.config, self.machine, self.memory, self.prediction
        m, d = cfg.model, cfg.data
        tokens = d.batch_size * d.seq_len
        accel = "GPU" if mc.gpu_bytes is not None else "CPU device"
        word = _device_word(mc)
        where = f"{mc.devices} device{'s' * (mc.devices > 1)} in {mc.processes} process"
        where += "es" * (mc.processes > 1)
        chosen = f"decided {', '.join(self.decided)}" if self.decided else "as configured"
        lines = [
            f"plan for {m.name}: {_count(param_count(m))} parameters, {d.batch_size} x {d.seq_len} = "
            f"{tokens:,} tokens per step, {cfg.optimizer.name} ({cfg.optimizer.state_dtype} moments), "
            f"{where}",
            f"placement: {self.plan.mode} ({chosen})",
        ]
        lines += [f"  {label}: {text}" for label, text in _unit_runs(self.plan, accel)]
        if self.plan.offloads_activations:
            lines.append(
                "  block inputs: wait for the backward pass in pinned host memory (all but the last)"
            )
        lines.append("memory, needed of available:")
        if mc.gpu_bytes is not None:
            gpu = self._gpu_needed()
            lines.append(
                f"  GPU per device  {gib(gpu)} of {gib(mc.gpu_usable)} (state "
                f"{gib(need.accelerator_state)}, activations ~{gib(need.activations)})"
            )
            pool = (
                "XLA's pool sized to it when jaxzero starts JAX"
                if mc.pinned_limit_gb is None
                else (
                    f"of XLA's {mc.pinned_limit_gb:g} GB pool, which needs "
                    f"{memory.pinned_pool_minimum_gb(need)} GB"
                )
            )
            if need.pinned:
                lines.append(f"  pinned host     {gib(need.pinned)} (part of host RAM; {pool})")
            lines.append(
                f"  host RAM        {gib(self._ram_needed())} of {gib(mc.host_usable)} "
                "(per process: masters and optimizer state, XLA's pinned pool, a checkpoint's buffer, and "
                f"{gib(memory.process_allowance(need))} for the process itself; "
                f"{HOST_HEADROOM:.0%} of the RAM left free)"
            )
        else:
            lines.append(
                f"  RAM             {gib(self._ram_needed())} of {gib(mc.host_usable)} (CPU backend: host "
                "and device state with XLA's and the checkpoint writer's buffers, and activations)"
            )
        if need.disk:
            lines.append(
                f"  local disk      {gib(need.disk * mc.local_processes)} of {gib(mc.disk_bytes)} free "
                f"(masters and optimizer state of {len(self.plan.disk_units)} "
                f"unit{'s' if len(self.plan.disk_units) != 1 else ''}, "
                f"{cfg.offload.disk_path or 'under the run directory'})"
            )
        if cfg.checkpoint.enabled:
            size = self.checkpoint_bytes()
            need, count = self.checkpoint_disk()
            lines.append(
                f"  checkpoints     {gib(size)} each, {gib(need)} of disk under run_dir at most "
                f"(checkpoint.keep={cfg.checkpoint.keep} and the next; {gib(mc.run_dir_bytes)} free "
                "there); a save or a restore adds "
                f"{gib(memory.checkpoint_bytes(cfg, _largest_unit_bytes(cfg), size))} of host RAM; a "
                f"save writes for ~{self.save_seconds():.3g} s at ~{CHECKPOINT_WRITE_BPS / GB:.2g} GB/s"
            )
        # 8N with N what a token multiplies by: a mixture's experts outside the top-k do not count
        active = param_count(m) - m.num_layers * inactive_expert_params(m)
        flops = 8 * active * tokens / p.step_s / mc.devices / 1e12
        lines += [
            f"predicted step: {p.step_s:.3g} s ({tokens / p.step_s:,.0f} tokens/s, {flops:.3g} TFLOP/s (8N) "
            f"per device); bottleneck: {_in_words(p.bottleneck, word)}",
            f"  {word} compute {p.gpu_s:.3g} s + host update before the forward {p.exposed_s:.3g} s, link "
            f"{p.link_s:.3g} s, host update {p.host_s:.3g} s"
            + (f", disk {p.disk_s:.3g} s" if self.plan.disk_units else "")
            if self.plan.host_update is not None
            else f"  {word} compute {p.gpu_s:.3g} s; nothing crosses the link or waits for the host",
        ]
        if self.warning:
            lines.append(f"  {self.warning}")
        defaults = f" (defaults: {mc.sources['defaults']})" if "defaults" in mc.sources else ""
        lines += [f"machine{defaults}:"] + [f"  {row}" for row in _machine_rows(mc)]
        lines.append(
            "These are predictions (the cost model of jaxzero/planner/cost.py, within 20% of the steps "
            "measured in BENCHMARKS.md), not measurements."
        )
        return "\n".join(lines)


def _frozen_part_words(cfg: TrainConfig) -> str:
    """The placement of a run with a frozen part: what trains, and where its base is."""
    ft = cfg.finetune
    where = "streamed from pinned host memory" if cfg.offload.params == "cpu" else "on the accelerator"
    if ft.method == "lora":
        return f"LoRA rank {ft.lora_rank}, the frozen {ft.base_dtype} base {where}"
    return f"units frozen ({ft.freeze}) in {ft.base_dtype} {where}, the others training on the accelerator"


def _frozen_part_table(d: Decision) -> str:
    """`Decision.table` of a run with a frozen part: what trains, the base's place, its memory (the
    base, the embedding and head, what trains with its state, the activations) and its step."""
    cfg, mc, need, p = d.config, d.machine, d.memory, d.prediction
    streamed = cfg.offload.params == "cpu"
    b = partial.partial_bytes(cfg, streamed)
    data = cfg.data
    tokens = data.batch_size * data.seq_len
    chosen = f"decided {', '.join(d.decided)}" if d.decided else "as configured"
    flops = partial.step_flops(cfg) / p.step_s / 1e12
    capacity = mc.gpu_usable if mc.gpu_usable is not None else mc.host_usable
    what = f"LoRA on {', '.join(cfg.finetune.targets)}" if cfg.finetune.method == "lora" else "units training"
    lines = [
        f"plan for {cfg.model.name}: {param_count(cfg.model) / 1e9:.2f}B parameters, "
        f"{data.batch_size} x {data.seq_len} = {tokens:,} tokens per step, {what} "
        f"({b.trainable // 4 / 1e6:.2f}M parameters train)",
        f"placement: {_frozen_part_words(cfg)} ({chosen})",
        "memory, needed of available:",
        f"  device     {gib(d._gpu_needed())} of {gib(capacity)} (base "
        f"{gib(0 if streamed else b.base_blocks)} + embedding and head {gib(b.base_edges)}, "
        f"what trains with gradients and {cfg.optimizer.name} state {gib(b.trainable_state)}, "
        f"activations ~{gib(need.activations)})",
    ]
    if need.pinned:
        lines.append(f"  pinned     {gib(need.pinned)} of host RAM (the base's blocks)")
    if mc.gpu_bytes is not None:
        lines.append(
            f"  host RAM   {gib(d._ram_needed())} of {gib(mc.host_usable)} (XLA's pinned pool and "
            f"{gib(memory.process_allowance(need))} for the process itself)"
        )
    if cfg.checkpoint.enabled:
        lines.append(
            f"  checkpoints {gib(d.checkpoint_bytes())} each (what trains, its optimizer state, the "
            "step; the base is rebuilt from the config)"
        )
    lines += [
        f"predicted step: {p.step_s:.3g} s ({tokens / p.step_s:,.0f} tokens/s, {flops:.3g} TFLOP/s "
        f"(its FLOPs: docs/lora.md)); bottleneck: {p.bottleneck}",
        "These are predictions, not measurements.",
    ]
    return "\n".join(lines)


def gib(nbytes: float) -> str:
    """`nbytes` in GiB for a plan's lines: one decimal."""
    return f"{nbytes / GiB:.1f} GiB"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 10**9 else f"{n / 1e6:.2f}M"


def _unit_runs(plan: OffloadPlan, accel: str) -> list[tuple[str, str]]:
    """(units, where they live) for each run of consecutive units that live alike, in forward order:
    ("embed, blocks 0-3", "weights GPU, state GPU (updated on GPU)")."""
    runs: list[list[UnitPlan]] = []
    for u in plan.units:
        if runs and (runs[-1][0].weights, runs[-1][0].state) == (u.weights, u.state):
            runs[-1].append(u)
        else:
            runs.append([u])
    out = []
    for run in runs:
        names = ["embed"] if run[0].kind is UnitKind.EMBED else []
        blocks = [u.block for u in run if u.kind is UnitKind.BLOCK]
        if blocks:
            names.append(f"block {blocks[0]}" if len(blocks) == 1 else f"blocks {blocks[0]}-{blocks[-1]}")
        if run[-1].kind is UnitKind.HEAD:
            names.append("head")
        u = run[0]
        weights = accel if u.weights is Tier.DEVICE else "streamed from pinned host"
        state = {
            Tier.DEVICE: f"{accel} (updated on {accel})",
            Tier.HOST: "host RAM (updated on CPU)",
            Tier.DISK: "local disk (read, updated on CPU, written back)",
        }[u.state]
        out.append((", ".join(names), f"weights {weights}, state {state}"))
    return out


def _device_word(mc: Machine) -> str:
    """What the plan calls the accelerator: a GPU, or a CPU backend's devices."""
    return "GPU" if mc.gpu_bytes is not None else "CPU"


def _in_words(bottleneck: str, word: str) -> str:
    """The cost model's bottleneck name ("GPU compute", ...) for the device that runs."""
    return bottleneck.replace("GPU", word)


def _machine_rows(mc: Machine) -> list[str]:
    s = mc.sources
    if mc.gpu_bytes is None:  # no GPU words for a CPU backend
        cpu = f"{mc.h2d / GB:.0f} GB/s between host and device memory, a copy in RAM"
        return [
            "devices      a CPU backend's: their arrays are in host RAM",
            f"host RAM     {gib(mc.host_bytes)} ({s.get('host_gib', '-')})",
            f"CPU cores    {mc.cores} ({s.get('cores', '-')})",
            f"copies       {cpu} ({s.get('h2d_gbps', '-')})",
            f"host update  {mc.host_bw / GB:.0f} GB/s of host memory traffic ({s.get('host_gbps', '-')})",
            f"compute      {mc.gpu_flops / 1e12:.3g} TFLOP/s (8N) per device ({s.get('gpu_tflops', '-')})",
            f"local disk   {gib(mc.disk_bytes)} free ({s.get('disk_gib', '-')}), "
            f"{mc.disk_bw / GB:.1f} GB/s read and written together ({s.get('disk_gbps', '-')})",
        ]
    first = f"GPU memory   {gib(mc.gpu_bytes)} per device"
    link = f"({s.get('h2d_gbps', '-')})"
    if s.get("h2d_gbps") != s.get("d2h_gbps"):
        link = f"({s.get('h2d_gbps', '-')}, back: {s.get('d2h_gbps', '-')})"
    share = f", {gib(mc.host_share)} per process" if mc.local_processes > 1 else ""
    return [
        f"{first} ({s.get('gpu_gib', '-')})",
        f"host RAM     {gib(mc.host_bytes)}{share} ({s.get('host_gib', '-')})",
        f"CPU cores    {mc.cores} ({s.get('cores', '-')})",
        f"link         {mc.h2d / GB:.0f} GB/s to the device, {mc.d2h / GB:.0f} GB/s back {link}",
        f"host update  {mc.host_bw / GB:.0f} GB/s of host memory traffic ({s.get('host_gbps', '-')})",
        f"compute      {mc.gpu_flops / 1e12:.3g} TFLOP/s (8N) per device ({s.get('gpu_tflops', '-')})",
        f"local disk   {gib(mc.disk_bytes)} free ({s.get('disk_gib', '-')}), "
        f"{mc.disk_bw / GB:.1f} GB/s read "
        f"and written together ({s.get('disk_gbps', '-')})",
    ]


# ---------------------------------------------------------------------------------------------------
# Refusals: what would fit instead
# ---------------------------------------------------------------------------------------------------


def refusal(
    *,
    cfg: TrainConfig,
    mc: Machine,
    strict: bool,
    frontier: list[Candidate],
    settings: list[str],
    batch: int | None,
    smallest_batch: int,
    largest_model: str | None,
    strict_of: Callable[[Candidate], bool],
) -> str:
    """Why nothing fits `mc`, in numbers, and what would: the text of the planner's ConfigError.
    `strict`: the mode was the planner's to choose; `frontier`: the placements a refusal reasons
    from (every mode, K and two-pass setting at the fewest resident blocks); `strict_of(e)`: whether
    `e` of them must hold its activations, as the search judges it; `settings`: the fewest
    settings of the run that make it fit ("key=value (why)"); `batch`: the largest data.batch_size
    that fits, None where none from `smallest_batch` up does; `largest_model`: the largest named
    model of the family that fits."""
    m, d = cfg.model, cfg.data
    head = (
        f"{m.name} ({_count(param_count(m))} parameters) at {d.batch_size} x {d.seq_len} tokens per "
        f"step does not fit this machine"
    )
    head += " in any placement the planner may choose" if strict else " as configured"
    if not frontier:
        return head + "."
    # The closest placement that the GPU holds (where one does): a placement that needs more GPU
    # memory than the machine has is no advice.
    on_this_gpu = [e for e in frontier if mc.gpu_bytes is None or e.gpu_need <= mc.gpu_usable]
    closest = min(on_this_gpu or frontier, key=lambda e: e.shortfall)
    need = closest.need
    if mc.gpu_bytes is not None:
        needs = (
            f"{gib(closest.gpu_need)} of GPU memory per device (state {gib(need.accelerator_state)}, "
            f"activations ~{gib(need.activations)}; {gib(mc.gpu_usable)} usable of "
            f"{gib(mc.gpu_bytes)}) and "
            f"{gib(closest.host_need)} of host RAM per process ({gib(mc.host_usable)} usable of "
            f"{gib(mc.host_share)})"
        )
        if closest.pool_short:
            pool_gb = memory.pinned_pool_minimum_gb(need)
            needs += f" and {pool_gb} GB of XLA's pinned pool ({mc.pinned_limit_gb:g} GB)"
    else:
        needs = (
            f"about {gib(closest.host_need)} of RAM on this CPU-only machine (host and device state with "
            f"XLA's and the checkpoint writer's buffers, and activations; {gib(mc.host_usable)} usable "
            f"of {gib(mc.host_share)})"
        )
    which = f"the closest placement, {_label(closest)}," if len(frontier) > 1 else _label(closest)
    # The fewest changes first, in the order a user would rather make them: settings of this run
    # (bf16 moments, one-pass updates), a smaller batch, then disk room or more memory.
    text = [f"{head}."]
    text.append(_settings_text(settings))
    text.append(_smaller_text(cfg, batch, smallest_batch, largest_model))
    text.append(_tiers(mc, strict_of, frontier))
    if on_this_gpu or mc.gpu_bytes is None:
        text.append(f"For the record, {which} needs {needs}.")
    return " ".join(t for t in text if t)


def partial_refusal(cfg: TrainConfig, mc: Machine, frontier: list[Candidate]) -> str:
    """Why a run with a frozen part fits `mc` in none of its placements (`frontier`: the base on the
    device, streamed, or both as `offload.params` allows), in numbers, and what would: the text of the
    planner's ConfigError."""
    capacity = mc.gpu_usable if mc.gpu_usable is not None else mc.host_usable
    rows = "; ".join(
        f"base {'streamed' if e.option.params == 'cpu' else 'on the device'}: "
        f"{gib(e.need.accelerator_state + e.need.activations)} of {gib(capacity)} device memory, "
        f"{gib(e.host_need)} of {gib(mc.host_usable)} host RAM"
        for e in frontier
    )
    ft = cfg.finetune
    hint = ""
    if ft.base_dtype != "int8" and cfg.model.family in ("llama", "gemma3", "gpt_oss"):
        hint += " finetune.base_dtype=int8 halves the base;"
    if ft.method == "full":
        hint += " freezing more units saves 16 bytes of each one's parameters;"
    return (
        f"{cfg.model.name} with a frozen part at {cfg.data.batch_size} x {cfg.data.seq_len} tokens per step "
        f"does not fit this machine: {rows}.{hint} a smaller data.batch_size (or more data.grad_accum: a "
        "streamed base crosses the link once per micro-batch) shrinks the activations"
        + ("; offload.params=cpu streams the base from host memory." if cfg.offload.params == "none" else ".")
    )


def _settings_text(settings: list[str]) -> str:
    """ "It fits with a, b and c." for the settings that make the run fit; "" for none."""
    if not settings:
        return ""
    joined = settings[0] if len(settings) == 1 else ", ".join(settings[:-1]) + " and " + settings[-1]
    return f"It fits with {joined}."


def _smaller_text(cfg: TrainConfig, batch: int | None, smallest_batch: int, largest_model: str | None) -> str:
    """The largest data.batch_size that fits with this model, and the largest named model size of
    its family that fits with these settings."""
    d = cfg.data
    text = (
        f"With this model data.batch_size={batch} fits ({batch * d.seq_len:,} tokens per step)"
        if batch
        else f"With this model no data.batch_size fits, not even {smallest_batch}"
    )
    if largest_model:
        return (
            f"{text}; the largest named model that fits with these settings is {largest_model} "
            f"({_count(param_count(NAMED_SIZES[largest_model]))} parameters)."
        )
    return f"{text}; no named {cfg.model.family} model fits with these settings at data.seq_len={d.seq_len}."


def _label(e: Candidate) -> str:
    o = e.cfg.offload
    keys = f"offload.optimizer={o.optimizer}, offload.params={o.params}"
    if o.optimizer == "disk":
        keys += f", offload.disk_units={o.disk_units}"
    if o.optimizer in ("cpu", "disk"):
        keys += f", offload.device_state_units={o.device_state_units}"
        keys += f", offload.two_pass_units={o.two_pass_units}"
    if o.params == "cpu":
        keys += f", offload.resident_blocks={o.resident_blocks}"
    if o.activations == "cpu":
        keys += ", offload.activations=cpu"
    return f"{e.plan.mode} ({keys})"


def _with_headroom(need: int) -> int:
    """The host RAM whose usable part (`Machine.host_usable`) holds `need` bytes."""
    return math.ceil(need / (1 - HOST_HEADROOM))


def _tiers(mc: Machine, strict: Callable[[Candidate], bool], frontier: list[Candidate]) -> str:
    """What memory to add, each alone: host RAM for a placement the accelerator holds, a larger
    accelerator for one host RAM holds (`strict(e)`: whether `e` must hold its activations)."""
    local = mc.local_processes
    if mc.gpu_bytes is None:
        ram = _with_headroom(min(e.host_need for e in frontier) * local)
        return f"To fit it, add memory: {gib(ram - mc.host_bytes)} more RAM ({gib(ram)} in all)."
    options = []
    gpu_ok = [
        e
        for e in frontier
        if not (e.gpu_short if strict(e) else e.state_short) and not (e.pool_short or e.disk_short)
    ]
    if gpu_ok:
        ram = _with_headroom(min(e.host_need for e in gpu_ok) * local)
        options.append(f"more host RAM: {gib(ram - mc.host_bytes)} more ({gib(ram)} in all)")
    host_ok = [
        e
        for e in frontier
        if not (e.host_short if strict(e) else e.host_state_short) and not (e.pool_short or e.disk_short)
    ]
    if host_ok:
        gpu = min(
            math.ceil(e.gpu_need / (1 - GPU_HEADROOM)) if strict(e) else e.need.accelerator_state
            for e in host_ok
        )
        options.append(f"a GPU with {gib(gpu)} of memory")
    disk_only = [e for e in frontier if e.disk_short and not (e.gpu_short or e.host_short or e.pool_short)]
    if disk_only:
        need = min(e.need.disk * local for e in disk_only)
        options.append(f"more free local disk: {gib(need)} at offload.disk_path ({gib(mc.disk_bytes)} free)")
    pool_only = [e for e in frontier if e.pool_short and not (e.gpu_short or e.host_short)]
    if pool_only:
        gb = min(memory.pinned_pool_minimum_gb(e.need) for e in pool_only)
        options.append(f"a larger pinned pool: {runtime.PINNED_POOL_ENV}={gb} (set before JAX starts)")
    if not options:
        return (
            "Neither more host RAM alone nor a larger GPU alone makes any placement fit: both are needed, "
            "or a smaller model."
        )
    return f"To fit it, add {' or '.join(options)}."


def _largest_unit_bytes(cfg: TrainConfig) -> int:
    """Masters and optimizer state of the model's largest unit (embedding, a block or the head)."""
    return max(unit_param_counts(cfg.model)) * (4 + memory.optimizer_state_bytes(cfg))

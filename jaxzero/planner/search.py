"""The placement planner's search: for this config on this machine, where every unit's weights and
state live.

`offload.params=auto` and `offload.optimizer=auto` (the defaults) leave the placement to `choose`,
which runs before anything is allocated. It enumerates the placements the config leaves open, keeps
those that fit the accelerator's memory and host RAM (`jaxzero.planner.candidates`), predicts each one's
step time (`jaxzero.planner.cost`), and picks the fastest: among placements predicted within 1% of the
fastest, the simplest (resident, then ZeRO-Offload, then ZeRO-3 offload; adaptive two-pass updates;
the fewest units with state on the accelerator; the fewest resident blocks).

    machine = detect_machine(cfg, device)       # jaxzero.planner.machine; or Machine(...)
    decision = choose(cfg, machine)             # ConfigError, with what would fit, if nothing does
    decision.config                             # cfg with every auto key decided
    print(decision.table())                     # jaxzero.planner.report

The candidates (only keys the user left open are decided; explicit ones are honoured):
- resident: `offload.optimizer=none`, `offload.params=none`;
- ZeRO-Offload: `offload.optimizer=cpu`, `offload.params=none`, with `offload.device_state_units`
  K = 0 .. num_layers + 1 (the first K units in forward order keep masters and state on the GPU:
  with exact clipping the next forward pass waits for the host to update the units it needs first,
  and each unit with its state on the GPU is ready at once);
- ZeRO-3 offload: `offload.optimizer=cpu`, `offload.params=cpu`, with `offload.resident_blocks` R and K.
`offload.two_pass_units` left at -1 (adaptive) becomes 0 for a placement that fits only so: two-pass
updates keep gradients in pinned memory a step longer. `offload.activations` left at none becomes cpu
(block inputs wait in pinned host memory) for an offloaded placement that fits only so: the copies
cost link time, (L - 1) block inputs each way per step, which the cost model's link term counts.
Where nothing fits and the optimizer is left open, the fewest last units whose state goes to the
local disk (`offload.optimizer=disk`) that make one fit. K, R, the two-pass count, the activations'
place and the disk units are decided only while the mode is (`offload.params` or `offload.optimizer`
auto, `resident_blocks` left at 0). K is decided whenever `offload.device_state_units` is left at -1
(its default) and the host updates units one step at a time: under an explicit ZeRO-Offload or ZeRO-3
mode too, where the machine has an accelerator of its own (the fewest first units within 1% of the
fastest, so a GPU without room keeps every unit's state on the host; a K above 0 must hold its
activations, the user's own K = 0 only its state).

A run with a frozen part (LoRA, `finetune.freeze`) is searched the same way over its own two options:
its frozen base on the accelerator (`offload.params=none`) or streamed from pinned host memory
(`cpu`), what trains on the accelerator either way (`offload.optimizer=none`); with
`offload.params=auto`, the base stays on the accelerator wherever that fits (it is never slower). It
trains on one device, and must hold its activations.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

from jaxzero.config import ConfigError, TrainConfig
from jaxzero.config.checks import validate
from jaxzero.models.sizes import NAMED_SIZES, param_count
from jaxzero.plan import resolve_plan
from jaxzero.planner import memory, partial
from jaxzero.planner.candidates import Candidate, Option, evaluate
from jaxzero.planner.cost import Prediction, predict
from jaxzero.planner.machine import Machine
from jaxzero.planner.memory import GiB
from jaxzero.planner.report import Decision, partial_refusal, refusal

# A placement must be predicted this much faster than a simpler one to be chosen over it: the model
# is good to ~20%, so smaller gains are not worth more memory or more moving parts.
PREFER_SIMPLER = 0.01
# The offload keys a decision may set (`Decision.decided` names those it did).
DECIDED_KEYS = (
    "params",
    "optimizer",
    "resident_blocks",
    "device_state_units",
    "two_pass_units",
    "activations",
    "disk_units",
)


def concrete(cfg: TrainConfig) -> bool:
    """Whether `cfg` names its placement itself (no `auto` offload key, and no unit count left to the
    planner where it applies): `resolve_plan` reads it as is, and `build_trainer` does not call the
    planner. A run with a frozen part never does: the search checks its base's place against the
    machine."""
    return (
        not cfg.finetune.partial
        and "auto" not in (cfg.offload.params, cfg.offload.optimizer)
        and not _open_device_state(cfg)
    )


def _open_device_state(cfg: TrainConfig, machine: Machine | None = None) -> bool:
    """Whether the planner chooses how many units keep their state on the accelerator
    (`offload.device_state_units=-1`, where the host updates units and one update follows the other).
    With an explicit mode, only where `machine` has an accelerator of its own: on a CPU backend its
    "device" update would run on the cores the host update needs."""
    o = cfg.offload
    if o.device_state_units != -1 or o.update != "overlapped":
        return False
    return o.optimizer == "auto" or (
        o.optimizer == "cpu" and (machine is None or machine.gpu_bytes is not None)
    )


def choose(cfg: TrainConfig, machine: Machine, whole: tuple[int, int, int] = (0, 0, 0)) -> Decision:
    """The placement of `cfg` on `machine`: every key `cfg` leaves open decided (see the module
    docstring), the fastest predicted placement that fits. `whole`: as `memory.plan_memory`'s, the
    parameters no ZeRO stage splits over the machine's devices. Raises ConfigError, before anything
    is allocated, if nothing fits: what the closest placement needs against what is available, and
    what would fit (a batch size, a named model size, more host RAM or a larger GPU, settings)."""
    if cfg.finetune.partial:
        partial.check_one_device(machine.devices)
    search = _Search(cfg, machine, whole)
    fitting = search.fitting()
    if not fitting:
        raise ConfigError(_refusal(search))
    fastest = min(search.predict(e).step_s for e in fitting)
    as_fast = [e for e in fitting if search.predict(e).step_s <= fastest * (1 + PREFER_SIMPLER)]
    chosen = min(as_fast, key=lambda e: e.option.rank)
    warning = None
    # Only an explicit placement is chosen with its state fitting and its activations not.
    if chosen.gpu_short or chosen.host_short:
        warning = (
            "warning: the activation estimate does not fit beside the state; if the run runs out of "
            "memory, lower data.batch_size or data.seq_len, or raise data.grad_accum."
        )
    given, placed = cfg.offload, chosen.cfg.offload
    decided = tuple(  # what the planner set: the auto keys, and any other it changed where it applies
        f"offload.{k}={getattr(placed, k)}"
        for k in DECIDED_KEYS
        if (getattr(given, k) == "auto" or getattr(given, k) != getattr(placed, k))
        and not (k == "device_state_units" and (chosen.plan.host_update is None or not search.k_open))
    )
    return Decision(
        config=chosen.cfg,
        plan=chosen.plan,
        memory=chosen.need,
        prediction=search.predict(chosen),
        machine=machine,
        decided=decided,
        warning=warning,
    )


def as_configured(cfg: TrainConfig, machine: Machine, whole: tuple[int, int, int] = (0, 0, 0)) -> Decision:
    """The `Decision` of a placement `cfg` names itself (`concrete`): its plan, memory and predicted
    step on `machine`, nothing decided. Whether it fits is checked where the run starts, on the
    devices it has (`runtime.check_fits`)."""
    plan = resolve_plan(cfg)
    pool_cap = None if machine.pinned_limit_gb is None else int(machine.pinned_limit_gb * GiB)
    need = memory.plan_memory(cfg, plan, machine.devices, machine.processes, whole, pool_cap)
    return Decision(
        config=cfg,
        plan=plan,
        memory=need,
        prediction=predict(cfg, plan, machine),
        machine=machine,
        decided=(),
    )


class _Search:
    """The options one config leaves open on one machine, each evaluated once."""

    def __init__(self, cfg: TrainConfig, machine: Machine, whole: tuple[int, int, int] = (0, 0, 0)):
        self.cfg, self.machine, self.whole = cfg, machine, whole
        o, layers = cfg.offload, cfg.model.num_layers
        self._evaluated: dict[Option, Candidate | None] = {}
        self._predicted: dict[Option, Prediction] = {}
        if cfg.finetune.partial:  # the frozen base on the accelerator or streamed; nothing else moves
            self.strict, self.k_open = True, False
            self.two_pass, self.activations = (o.two_pass_units,), (o.activations,)
            self.k_range, self.r_range = range(1), range(1)
            self.disk_fixed, self.disk_search = 0, False
            bases = {"auto": ("none", "cpu"), "none": ("none",), "cpu": ("cpu",)}[o.params]
            self.modes = [("none", params) for params in bases]
            return
        # A placement the planner chooses must hold its activations; the user's own mode, with every
        # unit's state on the host, is held only to what the memory check refuses.
        self.strict = "auto" in (o.params, o.optimizer)
        # Keys are decided only while the mode is: an explicit mode keeps its explicit meaning.
        self.two_pass = (-1, 0) if self.strict and o.two_pass_units == -1 else (o.two_pass_units,)
        # Block inputs move to pinned memory only where the accelerator cannot hold them (they cost
        # link time), and only while the mode is decided (the key left at its default, none).
        self.activations = ("none", "cpu") if self.strict and o.activations == "none" else (o.activations,)
        # Units with state on the accelerator: decided with an explicit mode too (the first-needed
        # units, to close the next forward pass's wait for the host where the accelerator has room).
        k = max(o.device_state_units, 0)
        self.k_open = _open_device_state(cfg, machine)
        # An explicit ZeRO-3 mode stays one: its last block at least streams.
        top = layers + 1 if o.params == "cpu" else layers + 2
        self.k_range = range(top) if self.k_open else range(k, k + 1)
        r = o.resident_blocks
        self.r_range = range(layers) if o.params == "auto" and not r else range(r, r + 1)
        # Units on disk: as given with offload.optimizer=disk; with auto, the fewest that make a
        # placement fit, searched only when none fits without (the disk is the slowest tier).
        self.disk_fixed = o.disk_units if o.optimizer == "disk" else 0
        self.disk_search = o.optimizer == "auto" and self.strict and o.update == "overlapped"
        self.modes: list[tuple[str, str]] = []  # (offload.optimizer, offload.params)
        if o.optimizer in ("auto", "none") and o.params != "cpu" and not (k or r):
            self.modes.append(("none", "none"))
        if o.optimizer != "none" and o.params != "cpu" and not r:
            self.modes.append(("cpu", "none"))
        if o.optimizer != "none" and o.params != "none":
            self.modes.append(("cpu", "cpu"))

    def strict_for(self, e: Candidate) -> bool:
        """Whether `e` must hold its activations: where the planner chose its mode, or chose to keep
        units' state on the accelerator beside the user's explicit mode."""
        return self.strict or (self.k_open and e.option.device_state_units > 0)

    def evaluate(self, option: Option) -> Candidate | None:
        """`option` evaluated, or None where the config's other settings rule it out (`validate`)."""
        if option not in self._evaluated:
            self._evaluated[option] = evaluate(self.cfg, option, self.machine, self.whole)
        return self._evaluated[option]

    def predict(self, e: Candidate) -> Prediction:
        if e.option not in self._predicted:
            self._predicted[e.option] = predict(e.cfg, e.plan, self.machine)
        return self._predicted[e.option]

    def at(
        self, optimizer: str, params: str, k: int, r: int, disk: int | None = None, *, disk_fits: bool = True
    ) -> list[Candidate]:
        """The options of one (mode, K, R, units on disk) that fit: with the user's two-pass setting,
        or, with it left adaptive, with 0 where adaptive does not fit. `disk_fits=False`: whether
        they fit but for the local disk."""
        disk = self.disk_fixed if disk is None or optimizer != "cpu" else disk
        for act in self.activations if optimizer == "cpu" else ("none",):
            for tp in self.two_pass:
                option = Option(
                    optimizer=optimizer,
                    params=params,
                    device_state_units=k,
                    resident_blocks=r,
                    two_pass_units=tp,
                    activations=act,
                    disk_units=disk if optimizer == "cpu" else 0,
                )
                e = self.evaluate(option)
                if e is not None and e.fits(self.strict_for(e), disk_fits):
                    return [e]
        return []

    def _overflows(self, optimizer: str, params: str, k: int, r: int) -> bool:
        """Whether (mode, K, R) overflows the accelerator under every two-pass setting."""
        acts = self.activations if optimizer == "cpu" else ("none",)
        disk = self.disk_fixed if optimizer == "cpu" else 0
        options = [
            self.evaluate(
                Option(
                    optimizer=optimizer,
                    params=params,
                    device_state_units=k,
                    resident_blocks=r,
                    two_pass_units=tp,
                    activations=a,
                    disk_units=disk,
                )
            )
            for tp in self.two_pass
            for a in acts
        ]
        shorts = [e.gpu_short if self.strict_for(e) else e.state_short for e in options if e is not None]
        return bool(shorts) and all(shorts)

    def fitting(self) -> list[Candidate]:
        """The options that fit worth comparing: per mode and K, the most resident blocks that fit
        and the fewest predicted as fast. (Accelerator memory grows with K and R, host memory falls
        with K, and the predicted step falls with both: binary searches, not every pair.) Where
        none fits and the planner may use the disk: per mode and K, the fewest units on disk that
        fit (host memory falls with them; the accelerator's does not change)."""
        out: list[Candidate] = []
        for optimizer, params in self.modes:
            ks = self.k_range if optimizer == "cpu" else range(1)
            for k in ks:
                found = self._fitting_at(optimizer, params, k, None)
                if found is None:
                    break  # more units with state on the accelerator overflow it more
                out += found
        if out or not self.disk_search:
            return out
        for optimizer, params in self.modes:
            if optimizer != "cpu":
                continue
            rs = self.r_range if params == "cpu" else range(1)
            for k in self.k_range:
                units = self.cfg.model.num_layers + 2 - k
                if not self.at(optimizer, params, k, rs[0], units, disk_fits=False):
                    continue  # not even with every host unit on disk (host RAM falls with them)
                fewest = _first(
                    range(1, units + 1),
                    lambda d: bool(self.at(optimizer, params, k, rs[0], d, disk_fits=False)),  # noqa: B023
                )
                out += self._fitting_at(optimizer, params, k, fewest) or []
        return out

    def _fitting_at(self, optimizer: str, params: str, k: int, disk: int | None) -> list[Candidate] | None:
        """`fitting`'s options for one mode, K and number of disk units; None where the accelerator
        overflows at the fewest resident blocks."""
        rs = self.r_range if params == "cpu" else range(1)
        rmax = _last(rs, lambda r: bool(self.at(optimizer, params, k, r, disk)))
        if rmax is None:
            return None if self._overflows(optimizer, params, k, rs[0]) else []
        best = self.at(optimizer, params, k, rmax, disk)
        limit = self.predict(best[0]).step_s * (1 + PREFER_SIMPLER)

        def as_fast(r: int) -> bool:
            return any(self.predict(e).step_s <= limit for e in self.at(optimizer, params, k, r, disk))

        return best + self.at(optimizer, params, k, _first(range(rs[0], rmax + 1), as_fast), disk)

    def frontier(self) -> list[Candidate]:
        """Every mode, K and two-pass setting at the fewest resident blocks (for that K, the least
        accelerator memory; host memory does not depend on R): what a refusal reasons from."""
        out = []
        for optimizer, params in self.modes:
            r = self.r_range[0] if params == "cpu" else 0
            for k in self.k_range if optimizer == "cpu" else range(1):
                disks = {self.disk_fixed if optimizer == "cpu" else 0}
                if optimizer == "cpu" and self.disk_search:
                    disks.add(-1)  # every host unit's state on disk: the least host RAM
                for tp in self.two_pass:
                    for act in self.activations if optimizer == "cpu" else ("none",):
                        for disk in sorted(disks):
                            option = Option(
                                optimizer=optimizer,
                                params=params,
                                device_state_units=k,
                                resident_blocks=r,
                                two_pass_units=tp,
                                activations=act,
                                disk_units=disk,
                            )
                            e = self.evaluate(option)
                            if e is not None:
                                out.append(e)
        return out

    def fits_somehow(self) -> bool:
        return any(e.fits(self.strict_for(e)) for e in self.frontier())


def _last(values: range, ok: Callable[[int], bool]) -> int | None:
    """The largest of `values` for which `ok` holds, `ok` holding on a prefix of them; None if on none."""
    if not len(values) or not ok(values[0]):
        return None
    lo, hi = 0, len(values) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(values[mid]) else (lo, mid - 1)
    return values[lo]


def _first(values: range, ok: Callable[[int], bool]) -> int:
    """The smallest of `values` for which `ok` holds, `ok` holding on a suffix of them that ends with
    the last."""
    lo, hi = 0, len(values) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(values[mid]) else (mid + 1, hi)
    return values[lo]


# ---------------------------------------------------------------------------------------------------
# Refusals: what would fit instead (`report.refusal` says it)
# ---------------------------------------------------------------------------------------------------


def _refusal(search: _Search) -> str:
    """Why nothing fits, in numbers, and what would: the fewest settings of this run, a smaller batch
    or a smaller named model, then more memory (`report.refusal` words it)."""
    cfg, mc = search.cfg, search.machine
    if cfg.finetune.partial:  # its own advice: a narrower base, more units frozen, the base streamed
        return partial_refusal(cfg, mc, search.frontier())
    d = cfg.data
    unit = d.grad_accum * mc.devices  # batch sizes validate accepts on this many devices
    frontier = search.frontier()
    if not frontier:  # no placement to reason from: the refusal's first sentence alone
        return refusal(
            cfg=cfg,
            mc=mc,
            strict=search.strict,
            frontier=frontier,
            settings=[],
            batch=None,
            smallest_batch=unit,
            largest_model=None,
            strict_of=search.strict_for,
        )
    batch = _last(range(unit, d.batch_size, unit), lambda b: _fits(_variant(cfg, data={"batch_size": b}), mc))
    settings = _settings_that_fit(search)
    return refusal(
        cfg=cfg,
        mc=mc,
        strict=search.strict,
        frontier=frontier,
        settings=settings,
        batch=batch,
        smallest_batch=unit,
        largest_model=_largest_model(search),
        strict_of=search.strict_for,
    )


def _variant(cfg: TrainConfig, **sections: dict[str, object]) -> TrainConfig:
    """`cfg` with fields of some sections replaced: `_variant(cfg, data={"batch_size": 8})`."""
    return dataclasses.replace(
        cfg, **{name: dataclasses.replace(getattr(cfg, name), **fields) for name, fields in sections.items()}
    )


def _fits(cfg: TrainConfig, machine: Machine, whole: tuple[int, int, int] = (0, 0, 0)) -> bool:
    """Whether `choose` would find a placement for `cfg`."""
    try:
        validate(cfg)
    except ConfigError:
        return False
    return _Search(cfg, machine, whole).fits_somehow()


def _largest_model(search: _Search) -> str | None:
    """The largest named model size of the config's family that fits with its other settings."""
    cfg, mc = search.cfg, search.machine
    # From the largest down, the first that fits: each try is a whole search.
    for name, model in reversed(sorted(NAMED_SIZES.items(), key=lambda kv: param_count(kv[1]))):
        if model.family != cfg.model.family or cfg.data.seq_len > model.max_seq_len:
            continue
        other = dataclasses.replace(model, compute_dtype=cfg.model.compute_dtype)
        if _fits(dataclasses.replace(cfg, model=other), mc):
            return name
    return None


def _settings_that_fit(search: _Search) -> list[str]:
    """The fewest settings that make this model fit at this batch size, each as "key=value (why)", of:
    bf16 moments, (for an explicit placement, which the planner does not adapt) one-pass updates, and
    (where attention stays inside documents) attention across them; none where no combination does."""
    cfg, mc, whole = search.cfg, search.machine, search.whole
    changes: list[tuple[str, dict[str, dict[str, object]]]] = []
    if cfg.optimizer.state_dtype == "float32" and memory.optimizer_state_bytes(cfg):
        bf16 = {"optimizer": {"state_dtype": "bfloat16"}}
        changes.append(("optimizer.state_dtype=bfloat16 (half the moments' bytes)", bf16))
    if not search.strict and cfg.offload.optimizer in ("cpu", "disk") and cfg.offload.two_pass_units == -1:
        one_pass = {"offload": {"two_pass_units": 0}}
        text = "offload.two_pass_units=0 (one-pass updates: no gradients kept pinned for a second pass)"
        changes.append((text, one_pass))
    if not cfg.data.cross_document_attention and cfg.data.eot_id >= 0:
        across = {"data": {"cross_document_attention": True}}
        text = (
            "data.cross_document_attention=true (attention across documents: the GPU holds no "
            "(rows, heads, seq_len, seq_len) document masks)"
        )
        changes.append((text, across))
    for size in range(1, len(changes) + 1):
        for chosen in itertools.combinations(changes, size):
            sections: dict[str, dict[str, object]] = {}
            for _, change in chosen:
                for name, fields in change.items():
                    sections[name] = {**sections.get(name, {}), **fields}
            if _fits(_variant(cfg, **sections), mc, whole):
                return [text for text, _ in chosen]
    return []

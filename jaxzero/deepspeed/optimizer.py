"""The `optimizer` and `scheduler` sections of a DeepSpeed config as jaxzero's `optimizer.*` settings:
Adam, AdamW, Lion and SGD with torch's defaults where the file leaves a parameter out, and DeepSpeed's
WarmupLR, WarmupDecayLR and WarmupCosineLR as jaxzero's schedules."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxzero.config import TrainConfig
from jaxzero.deepspeed.reading import Reader, Translation

_OPTIMIZERS = {"adam": "Adam", "adamw": "AdamW", "lion": "Lion", "sgd": "SGD"}
_OPT_PARAMS = {
    "adam": {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "bias_correction", "amsgrad", "torch_adam"},
    "lion": {"lr", "betas", "weight_decay"},
    "sgd": {"lr", "momentum", "weight_decay", "dampening", "nesterov"},
}
_OPT_PARAMS["adamw"] = _OPT_PARAMS["adam"]
_SCHEDULERS = {
    "WarmupLR": {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"},
    "WarmupDecayLR": {
        "warmup_min_lr",
        "warmup_max_lr",
        "warmup_num_steps",
        "warmup_type",
        "total_num_steps",
        "last_batch_iteration",
    },
    "WarmupCosineLR": {
        "warmup_min_ratio",
        "warmup_num_steps",
        "cos_min_ratio",
        "warmup_type",
        "total_num_steps",
        "last_batch_iteration",
    },
}


def translate_optimizer(ds: Mapping[str, Any], base: TrainConfig, r: Reader, out: Translation) -> None:
    """The `optimizer` section of `ds` into `out` (`optimizer.name`, `lr`, betas, ...); `base` gives the
    weight decay jaxzero keeps where the file says "auto"."""
    opt = r.section(ds, "optimizer", "optimizer", {"type", "params", "legacy_fusion"})
    if opt is None:
        return
    kind = r.get(opt, "type", "optimizer.type", str)
    if kind is None or kind.lower() not in _OPTIMIZERS:
        raise r.error(
            "optimizer.type",
            f"{opt.get('type')!r}: jaxzero runs {', '.join(_OPTIMIZERS.values())} (optax's); "
            "others (OneBitAdam, Lamb, ...) are not offered.",
        )
    kind = kind.lower()
    params = r.section(opt, "params", "optimizer.params", _OPT_PARAMS[kind]) or {}
    p = lambda key, k=float: r.get(params, key, f"optimizer.params.{key}", k)  # noqa: E731
    o = out.overrides
    if "params" not in opt:
        out.notes.append("optimizer has no params: torch's defaults for its type apply (lr 1e-3).")

    # Absent params take the defaults DeepSpeed's (torch's) optimizers have; "auto" keeps jaxzero's.
    def param(key: str, jaxzero_key: str, default: Any) -> None:  # the file's value, torch's if left out
        value = p(key)
        if value is not None or key not in params:
            written = params.get(key)
            out.set(
                jaxzero_key,
                default if value is None else value,
                f"optimizer.params.{key}",
                written,
                value is None,
            )

    param("lr", "optimizer.lr", 1e-3)
    if kind in ("adam", "adamw"):
        w_mode = p("adam_w_mode", bool)
        decay = p("weight_decay")
        if kind == "adam" and w_mode is False:
            if decay:
                raise r.error(
                    "optimizer.params.weight_decay",
                    f"{decay} with adam_w_mode false is L2 regularisation added to the gradient; jaxzero "
                    "decays weights decoupled (AdamW) only. Set adam_w_mode true or weight_decay 0.",
                )
            out.set("optimizer.name", "adam", "optimizer.params.adam_w_mode", False)
            out.set("optimizer.weight_decay", 0.0, "optimizer.params.adam_w_mode", False)
        else:  # DeepSpeed's Adam is AdamW unless adam_w_mode is false
            out.set("optimizer.name", "adamw", "optimizer.type", opt["type"])
        if p("bias_correction", bool) is False:
            raise r.error(
                "optimizer.params.bias_correction", "false: jaxzero's Adam always corrects the moments' bias."
            )
        if p("amsgrad", bool):
            raise r.error("optimizer.params.amsgrad", "true: AMSGrad is not offered; set it false.")
        if "torch_adam" in params:
            out.ignored.append("optimizer.params.torch_adam: the update is jaxzero's (fused kernel or optax)")
        _betas(params, r, out, (0.9, 0.999))
        param("eps", "optimizer.eps", 1e-8)
    elif kind == "lion":
        out.set("optimizer.name", "lion", "optimizer.type", opt["type"])
        _betas(params, r, out, (0.9, 0.99))
    else:
        out.set("optimizer.name", "sgd", "optimizer.type", opt["type"])
        param("momentum", "optimizer.momentum", 0.0)
        dampening = p("dampening")
        if dampening:
            raise r.error(
                "optimizer.params.dampening", f"{dampening}: SGD dampening is not offered; set it 0."
            )
        if p("nesterov", bool):
            raise r.error(
                "optimizer.params.nesterov", "true: Nesterov momentum is not offered; set it false."
            )
    if o.get("optimizer.name") != "adam":
        param("weight_decay", "optimizer.weight_decay", 0.0)
    if (
        o.get("optimizer.weight_decay", base.optimizer.weight_decay)
        and not base.optimizer.decay_norms_biases_embeddings
    ):
        out.notes.append(
            "weight decay applies to matrices, not to norms, biases or embeddings (as the Hugging Face "
            "Trainer groups them); --optimizer.decay_norms_biases_embeddings=true decays every parameter."
        )
    if "legacy_fusion" in opt:
        out.ignored.append("optimizer.legacy_fusion: the update is jaxzero's (fused kernel or optax)")


def _betas(params: Mapping[str, Any], r: Reader, out: Translation, default: tuple[float, float]) -> None:
    betas = r.get(params, "betas", "optimizer.params.betas", list)
    if betas is None and "betas" in params:  # "auto"
        return
    left_out = betas is None
    betas = list(default) if betas is None else betas
    if len(betas) != 2 or not all(isinstance(b, int | float) and not isinstance(b, bool) for b in betas):
        raise r.error("optimizer.params.betas", f"{betas!r} must be a list of two numbers.")
    for key, beta in (("optimizer.b1", betas[0]), ("optimizer.b2", betas[1])):
        out.set(key, float(beta), "optimizer.params.betas", betas, left_out)


def translate_scheduler(ds: Mapping[str, Any], base: TrainConfig, r: Reader, out: Translation) -> None:
    """The `scheduler` section of `ds` into `out` (`optimizer.schedule`, warmup, decay); `base` gives
    the schedule and peak rate jaxzero keeps where the file leaves them out or says "auto"."""
    sched = r.section(ds, "scheduler", "scheduler", {"type", "params"})
    if sched is None:
        if "optimizer" in ds:
            out.notes.append(
                f"no scheduler: jaxzero's optimizer.schedule={base.optimizer.schedule!r} with "
                f"warmup_steps={base.optimizer.warmup_steps} applies (DeepSpeed alone keeps lr constant; "
                "--optimizer.schedule=constant --optimizer.warmup_steps=0 for that)."
            )
        return
    kind = r.get(sched, "type", "scheduler.type", str)
    if kind not in _SCHEDULERS:
        raise r.error(
            "scheduler.type",
            f"{sched.get('type')!r}: jaxzero runs {', '.join(_SCHEDULERS)}; OneCycle and LRRangeTest are "
            "not offered.",
        )
    params = r.section(sched, "params", "scheduler.params", _SCHEDULERS[kind]) or {}
    p = lambda key, k=float: r.get(params, key, f"scheduler.params.{key}", k)  # noqa: E731
    o = out.overrides

    def param(key: str, jaxzero_key: str, value: Any) -> None:  # `value`: from the file, or its default
        out.set(jaxzero_key, value, f"scheduler.params.{key}", params.get(key), key not in params)

    steps = p("warmup_num_steps", int)
    if steps is not None or "warmup_num_steps" not in params:
        if steps is not None and steps < 1:
            raise r.error("scheduler.params.warmup_num_steps", f"{steps} must be >= 1.")
        warmup = max(2, 1000 if steps is None else steps)  # at least 2, as DeepSpeed's
        param("warmup_num_steps", "optimizer.warmup_steps", warmup)
    warmup_type = p("warmup_type", str)
    if warmup_type is not None and warmup_type not in ("log", "linear"):
        raise r.error("scheduler.params.warmup_type", f'{warmup_type!r} must be "log" or "linear".')
    if warmup_type is not None or "warmup_type" not in params:
        param("warmup_type", "optimizer.warmup_type", warmup_type or "log")
    if kind == "WarmupCosineLR":
        out.set("optimizer.schedule", "cosine", "scheduler.type", kind)
        start = p("warmup_min_ratio")
        if start is not None or "warmup_min_ratio" not in params:
            param("warmup_min_ratio", "optimizer.warmup_start_ratio", 0.0 if start is None else start)
        floor = p("cos_min_ratio")
        if floor is not None or "cos_min_ratio" not in params:
            param("cos_min_ratio", "optimizer.min_lr_ratio", 1e-4 if floor is None else floor)
    else:
        out.set("optimizer.schedule", "constant" if kind == "WarmupLR" else "linear", "scheduler.type", kind)
        if kind == "WarmupDecayLR":
            out.set("optimizer.min_lr_ratio", 0.0, "scheduler.type", kind)  # decays to 0 at total_num_steps
        top = p("warmup_max_lr")
        if top is not None:
            param("warmup_max_lr", "optimizer.lr", top)
        elif "warmup_max_lr" not in params and kind == "WarmupDecayLR":
            # WarmupDecayLR's default; WarmupLR's is the optimizer's lr
            param("warmup_max_lr", "optimizer.lr", 1e-3)
        low = p("warmup_min_lr")
        peak = o.get("optimizer.lr", base.optimizer.lr)
        if low is not None:
            if not 0 <= low <= peak or peak <= 0:
                raise r.error(
                    "scheduler.params.warmup_min_lr", f"{low} must be in [0, warmup_max_lr={peak}]."
                )
            param("warmup_min_lr", "optimizer.warmup_start_ratio", low / peak)
        elif "warmup_min_lr" not in params:
            param("warmup_min_lr", "optimizer.warmup_start_ratio", 0.0)
    if kind != "WarmupLR":
        total = p("total_num_steps", int)
        if total is None and "total_num_steps" not in params:
            raise r.error("scheduler.params.total_num_steps", f'{kind} needs total_num_steps (or "auto").')
        if total is not None and total < 1:
            raise r.error(
                "scheduler.params.total_num_steps", f'{total} must be >= 1 ("auto": the run\'s steps).'
            )
        if total is not None:  # "auto": the run's steps, as the HF Trainer fills it
            param("total_num_steps", "optimizer.decay_steps", total)
    if "last_batch_iteration" in params:
        out.ignored.append("scheduler.params.last_batch_iteration: a resumed run continues its own schedule")
    out.notes.append(
        f"{kind}: DeepSpeed's formula at each count of updates applied"
        + (
            " (its cosine phase counted from warmup_num_steps, DeepSpeed's from one before)"
            if kind == "WarmupCosineLR"
            else ""
        )
        + "; DeepSpeed's engine applies each rate one update later (its first two use the starting rate)."
    )

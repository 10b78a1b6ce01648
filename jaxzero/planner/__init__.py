"""The planner: one home for the decision of where each array lives.

A program resolves its config and decides the placement once, here, before JAX starts
(`preflight.decide_before_jax`); a library caller's `build_trainer` does it once on the running
backend's devices (`preflight.decide`). The result (`report.Decision`) carries the final config,
which the trainer and the loop trust and never check again.

    preflight.py    the resolution pass: validation, the end-of-text id, the machine, the batch for
                    its devices, then the placement (`decide`); XLA's pools sized for it
    machine.py      the machine planned for (`Machine`, `detect_machine`)
    memory.py       how many bytes: per unit and tier, the pinned pool, activations, capacity rules
    calibration.py  the measured constants of the cost model and the memory plan
    cost.py         a placement's predicted step time (`predict`)
    candidates.py   the placements it may choose (`Option`) and each one's memory (`evaluate`)
    search.py       the fastest placement that fits (`choose`), or a refusal
    partial.py      what a run with a frozen part (LoRA, `finetune.freeze`) weighs and costs, which
                    the same candidates, cost model and search place
    report.py       what was decided, for a person (`Decision`, its table, the refusal's text)

The plan the engines read (`jaxzero.plan`: `OffloadPlan`, `Tier`, `resolve_plan`) sits below this
package and imports nothing of it. This module imports nothing, so that loading the calibration or
the memory counts loads nothing that decides.
"""

"""The table of docs/how-big.md ("What it plans for one H200 and one H100"): the planner's decision for
each named model at 16K and 32K tokens per step, fp32 and bf16 moments, on an H200 and an H100 80 GB
box (125 GiB of host RAM, 16 cores, 1,000 GiB of free local disk), checkpoints on (the default): a
placement whose checkpoints the disk cannot hold is refused, as the program refuses it. Runs on any
machine: it starts no backend.

    python scripts/plan_table.py
"""

from __future__ import annotations

import re

from jaxzero.config import ConfigError
from jaxzero.overrides import parse_args
from jaxzero.planner import preflight

MODELS = ("llama-3.4b-bench", "llama-7b", "llama-13b", "llama-20b")
GPUS = (("H200", 133), ("H100", 75))


def cell(args: list[str]) -> str:
    """One decision in brief: placement, predicted step, bottleneck; or the refusal's first advice."""
    cfg = parse_args(args)
    try:
        d = preflight.decide(cfg)  # as `python -m jaxzero.plan` and the run decide
    except ConfigError as e:
        text = str(e)
        fits = re.search(r"It fits with (\S+?)=(\S+)", text)
        if fits:
            return f"refused; fits with {fits.group(1)}={fits.group(2)}"
        largest = re.search(r"the largest named model that fits with these settings is (\S+)", text)
        return f"refused; largest that fits: {largest.group(1)}" if largest else "refused"
    plan, extras = d.plan, []
    if plan.device_state_units and plan.host_update is not None:
        extras.append(f"{plan.device_state_units} units' state on the GPU")
    if plan.disk_units:
        extras.append(f"{len(plan.disk_units)} units' state on disk")
    if plan.host_update is not None and plan.host_update.two_pass.max_units == 0:
        extras.append("one-pass updates")
    more = f" ({', '.join(extras)})" if extras else ""
    placed = f"{plan.mode}{more}: {d.step_s:.3g} s, {d.bottleneck}"
    if d.checkpoint_shortfall() is not None:  # as `python -m jaxzero.plan` and train refuse it
        need, count = d.checkpoint_disk()
        return f"refused: checkpoints need {count} x {need / count / 2**30:.0f} GiB of disk ({placed})"
    return placed


def main() -> None:
    print("| model | tokens per step | H200 | H200, lean | H100 | H100, lean |")
    print("| --- | --- | --- | --- | --- | --- |")
    for model in MODELS:
        for batch in (8, 16):
            cells = []
            for _, gib in GPUS:
                for lean in ([], ["--optimizer.state_dtype=bfloat16"]):
                    cells.append(
                        cell(
                            [
                                f"--model.name={model}",
                                "--data.seq_len=2048",
                                f"--data.batch_size={batch}",
                                *lean,
                                f"--machine.gpu_gib={gib}",
                                "--machine.host_gib=125",
                                "--machine.cores=16",
                                "--machine.disk_gib=1000",
                            ]  # fmt: skip
                        )
                    )
            print(f"| `{model}` | {batch} x 2048 | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

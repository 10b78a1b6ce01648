"""End to end, as a user fine-tunes a released checkpoint, offline: a Hugging Face checkpoint of
`--model`'s shape with random weights, imported, fine-tuned with full offload on text prepared with
`python -m jaxzero.prepare`, exported, and reloaded by transformers, whose logits must match jaxzero's.

    python scripts/e2e_finetune.py --model=llama-3.1-8b --steps=200 --seq=1024 --batch=8 --out=/tmp/e2e

Stages, each in its own process (so each sizes its own accelerator memory and pinned pool):
  1. base:    random float32 init of the named shape, exported as bf16 safetensors (`OUT/base`);
  2. prepare: the byte-level tokens of Python's standard library (`OUT/data`; the machines are
              offline, and byte ids are valid in every vocabulary);
  3. train:   what `python -m jaxzero.train --model.name=hf:OUT/base` runs, under full offload:
              `offload.params=cpu` and `offload.optimizer=cpu` (every block streamed, every unit
              updated on the CPU) with bf16 moments and one-pass updates, which 8B needs on a
              125 GiB host (fp32 moments need 159 GiB: `python -m jaxzero.plan` says so); checkpoints
              off (an 8B checkpoint would not fit the lent disk beside the rest); then
              `export_state` of the trained weights (`OUT/tuned`);
  4. compare: transformers loads `OUT/tuned`; its float32 logits on held-out windows against
              jaxzero's float32 forward of the same files.
  5. report:  prints the loss curve's ends, the times and the logit agreement; writes `OUT/e2e.json`.
`--stage=all` runs them in order; a single `--stage=NAME` runs one (a device command that must stay
under a time limit), each recording its wall time in `OUT/times.json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def stage_base(args: argparse.Namespace) -> None:
    import jax

    from jaxzero.config import ModelConfig
    from jaxzero.interop import export_hf
    from jaxzero.models import build_model

    jax.config.update("jax_threefry_gpu_kernel_lowering", True)
    cfg = ModelConfig.named(args.model)
    init_cfg = dataclasses.replace(cfg, attention_impl="xla")  # the init runs on the CPU backend
    with jax.default_device(jax.devices("cpu")[0]):  # host RAM holds the float32 init, not the GPU
        params = jax.device_get(build_model(init_cfg).init(jax.random.key(args.seed)))
    export_hf(params, cfg, Path(args.out) / "base", dtype="bfloat16")


def stage_train(args: argparse.Namespace) -> None:
    import jax
    import numpy as np

    from jaxzero.data import build_data
    from jaxzero.interop import load_hf_into
    from jaxzero.interop.state_export import export_state
    from jaxzero.overrides import parse_args
    from jaxzero.trainer import build_trainer

    out = Path(args.out)
    cfg = parse_args(
        [
            f"--model.name=hf:{out / 'base'}",
            "--data.source=tokens",
            f"--data.path={out / 'data'}",
            f"--data.seq_len={args.seq}",
            f"--data.batch_size={args.batch}",
            f"--steps={args.steps}",
            "--offload.params=cpu",
            "--offload.optimizer=cpu",
            "--optimizer.state_dtype=bfloat16",
            "--offload.two_pass_units=0",
            "--checkpoint.enabled=false",
            f"--optimizer.lr={args.lr}",
            "--optimizer.warmup_steps=10",
            *(a if a.startswith("--") else f"--{a}" for a in args.set),
        ]
    )
    trainer = build_trainer(cfg)
    data = build_data(cfg.data, cfg.model.vocab_size, cfg.seed)
    state = trainer.init_from_params(load_hf_into(cfg.model, cfg.model.init_from))  # the base weights
    batches = data.train_iter()
    losses, marks, t0 = [], {}, time.perf_counter()
    for step in range(1, cfg.steps + 1):
        state, m = trainer.step(state, trainer.put_batch(next(batches)))
        if step == 1 or step % 10 == 0 or step == cfg.steps:
            losses.append((step, float(jax.device_get(m.loss))))  # host sync
            marks[step] = time.perf_counter() - t0
            print(f"step {step} loss {losses[-1][1]:.4f} ({marks[step]:.0f} s)", flush=True)
    wall = time.perf_counter() - t0
    first = min(s for s in marks if s > 1)  # steady state: from the first mark after the compile
    steady = (marks[cfg.steps] - marks[first]) / max(cfg.steps - first, 1)
    val = trainer.evaluate(state, data.val_batches(2))
    export_state(trainer, state, out / "tuned", dtype="float32")
    np.save(out / "val_windows.npy", data.val_batches(1)[0][:2])
    gpu = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    measured = {"train_s": wall, "step_s": steady, "peak_rss_gib": rss / 2**30, "peak_gpu_gib": gpu / 2**30}
    (out / "train.json").write_text(json.dumps({"losses": losses, "val_loss": val, **measured}))


def stage_compare(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    import transformers

    out = Path(args.out)
    windows = np.load(out / "val_windows.npy")[:, :-1]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    hf = transformers.AutoModelForCausalLM.from_pretrained(out / "tuned", dtype=torch.float32).to(dev).eval()
    with torch.no_grad():
        want = hf(torch.from_numpy(windows).long().to(dev)).logits.float().cpu().numpy()
    hf_class = type(hf).__name__
    del hf
    if dev == "cuda":
        torch.cuda.empty_cache()
    import jax
    import jax.numpy as jnp

    from jaxzero.interop import import_hf
    from jaxzero.models import build_model, forward

    cfg, params = import_hf(out / "tuned")
    cfg = dataclasses.replace(cfg, compute_dtype="float32", attention_impl="xla")
    with jax.default_matmul_precision("highest"):
        got = np.asarray(forward(build_model(cfg), params, jnp.asarray(windows)))
    err = float(np.max(np.abs(got.astype(np.float64) - want)) / np.max(np.abs(want)))
    (out / "compare.json").write_text(json.dumps({"rel_err": err, "transformers_class": hf_class}))
    print(f"transformers vs jaxzero float32 logits: max |d| / max |logit| = {err:.2e}")


def stage_prepare(args: argparse.Namespace) -> None:
    stdlib = Path(json.__file__).parent.parent
    cmd = [
        sys.executable,
        "-m",
        "jaxzero.prepare",
        f"--input={stdlib}/[a-m]*.py",
        f"--out={Path(args.out) / 'data'}",
        "--val_docs=20",
    ]
    subprocess.run(cmd, check=True, cwd=HERE)


def stage_report(args: argparse.Namespace) -> None:
    out = Path(args.out)
    trained = json.loads((out / "train.json").read_text())
    compare = json.loads((out / "compare.json").read_text())
    times = json.loads((out / "times.json").read_text())
    result = {
        "model": args.model,
        "steps": args.steps,
        "seq": args.seq,
        "batch": args.batch,
        "times_s": times,
        **trained,
        **compare,
    }
    (out / "e2e.json").write_text(json.dumps(result, indent=1))
    (first, l0), (last, l1) = trained["losses"][0], trained["losses"][-1]
    print(
        f"{args.model}: loss {l0:.3f} (step {first}) -> {l1:.3f} (step {last}), "
        f"val {trained['val_loss']:.3f}; "
        f"{trained['step_s']:.2f} s/step; "
        f"peak RSS {trained['peak_rss_gib']:.1f} GiB, GPU {trained['peak_gpu_gib']:.1f} GiB; "
        f"logits vs transformers {compare['rel_err']:.1e}; "
        f"stages {times}"
    )


STAGES = {
    "base": stage_base,
    "prepare": stage_prepare,
    "train": stage_train,
    "compare": stage_compare,
    "report": stage_report,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--set", action="append", default=[], help="more --section.key=value for the training")
    ap.add_argument("--stage", choices=("all", *STAGES), default="all")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.stage == "all":
        rest = [a for a in sys.argv[1:] if not a.startswith("--stage")]
        for name in STAGES:  # each stage in its own process
            subprocess.run([sys.executable, __file__, f"--stage={name}", *rest], check=True, cwd=HERE)
        return
    t = time.perf_counter()
    STAGES[args.stage](args)
    if args.stage != "report":
        times_file = out / "times.json"
        times = json.loads(times_file.read_text()) if times_file.exists() else {}
        times[args.stage] = round(time.perf_counter() - t, 1)
        times_file.write_text(json.dumps(times))


if __name__ == "__main__":
    main()

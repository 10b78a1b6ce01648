"""Host RAM a blocking checkpoint save and a restore take: streamed (`jaxzero.checkpoint.TRANSFER_BYTES`
at a time) against all at once, each variant in a fresh process.

    python scripts/bench_checkpoint_memory.py --model=llama-3.4b-bench --dir=/tmp/jz-ckpt-mem \
        --set offload.device_state_units=12

Builds the trainer for the model with `offload.optimizer=cpu` (and the `--set` overrides), takes one
step, then does a blocking save (`checkpoint.async_save=false`) and a restore of it beside the live
state, each with the process's peak RSS reset before it (`/proc/self/clear_refs`), and reports how
far the peak rose above the RSS before the operation (the save) or after it (the restore: the
restored state itself stays). "whole" is the behaviour before streaming: every array copied out in
one batch, and a restore read at Orbax's default concurrency. Each variant runs in its own process
(`--variant`; the parent runs both): an allocator keeps what a first save freed, so a second save in
the same process would rise less above its starting RSS. Linux only. Prints a table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time

import jax
import numpy as np

from jaxzero import checkpoint as checkpoint_lib
from jaxzero.checkpoint import Checkpointer, largest_array_bytes, make_meta
from jaxzero.config import TrainConfig
from jaxzero.overrides import apply_overrides
from jaxzero.trainer import build_trainer

GB = 1e9


def _status(key: str) -> int:
    """A /proc/self/status line in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.4b-bench")
    ap.add_argument("--dir", default="/tmp/jaxzero-bench-ckpt-mem")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument(
        "--variant", choices=["streamed", "whole"], help="run this one here (else each in a child)"
    )
    args = ap.parse_args()
    if args.variant is None:
        rows = []
        for variant in ("streamed", "whole"):
            out = subprocess.run(
                [sys.executable, *sys.argv, f"--variant={variant}"], capture_output=True, text=True
            )
            sys.stderr.write(out.stderr[-4000:])
            lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
            rows += lines
            print(next((line for line in out.stdout.splitlines() if line.startswith(args.model)), ""))
        print(f"{'what':18} {'host RAM over, GB':>18} {'s':>7}")
        for r in rows:
            print(f"{r['what']:18} {r['peak_over_GB']:18.2f} {r['s']:7.1f}")
        return
    over = {
        "model.name": args.model,
        "data.seq_len": str(args.seq),
        "data.batch_size": "1",
        "steps": "10",
        "offload.optimizer": "cpu",
        "offload.params": "none",
        "checkpoint.async_save": "false",
        "data.source": "synthetic",
        **dict(kv.split("=", 1) for kv in args.set),
    }
    cfg = apply_overrides(TrainConfig(), over)
    trainer = build_trainer(cfg)
    state = trainer.init(jax.random.key(0))
    state, m = trainer.step(state, trainer.put_batch(np.zeros((1, 1, args.seq + 1), np.int32)))
    jax.block_until_ready(m)
    abstract = trainer.abstract_saved_state()
    largest = largest_array_bytes(abstract)
    saved = trainer.saved_state(state)
    on_accelerator = sum(
        x.nbytes for x in jax.tree.leaves(saved) if next(iter(x.devices())).platform != "cpu"
    )
    nbytes = sum(x.nbytes for x in jax.tree.leaves(saved))
    rows = []
    batch = checkpoint_lib.TRANSFER_BYTES
    variants = {"streamed": (checkpoint_lib.TRANSFER_BYTES, largest), "whole": (10**15, None)}
    name = args.variant
    transfer, restore_largest = variants[name]
    checkpoint_lib.TRANSFER_BYTES = transfer
    directory = f"{args.dir}/{name}"
    shutil.rmtree(directory, ignore_errors=True)
    ckpt = Checkpointer(directory, cfg.checkpoint, largest_array=restore_largest)
    meta = make_meta(1, {"epoch": 0, "cursor": 0, "num_windows": 1}, cfg, trainer.layout, saved)
    before = _status("VmRSS")
    _reset_peak()
    t = time.perf_counter()
    ckpt.save(1, saved, meta)
    ckpt.wait()  # host sync: committed
    rows.append({"what": f"{name} save", "peak_over_GB": (_status("VmHWM") - before) / GB})
    rows[-1]["s"] = time.perf_counter() - t
    print(json.dumps(rows[-1]), flush=True)
    _reset_peak()  # the restore beside the live state: what it adds past its own arrays
    t = time.perf_counter()
    restored = trainer.from_saved_state(ckpt.restore(1, abstract, trainer.layout, cfg).state)
    jax.block_until_ready(restored.params)
    seconds = time.perf_counter() - t
    peak, after = _status("VmHWM"), _status("VmRSS")
    rows.append({"what": f"{name} restore", "peak_over_GB": (peak - after) / GB, "s": seconds})
    print(json.dumps(rows[-1]), flush=True)
    ckpt.close()
    del restored
    shutil.rmtree(args.dir, ignore_errors=True)
    print(
        f"{args.model}: {nbytes / GB:.1f} GB of masters + optimizer state, {on_accelerator / GB:.1f} GB of "
        f"it on the accelerator ({trainer.strategy}); streamed {batch / GB:.1f} GB at a time; "
        f"device {jax.devices()[0].device_kind}"
    )


if __name__ == "__main__":
    main()

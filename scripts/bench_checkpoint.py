"""How long a checkpoint blocks training, and how fast it is written, for host-resident offload state.

    python scripts/bench_checkpoint.py --model=llama-3.4b-bench --dir=/tmp/ckpt

Builds the ZeRO-3 offload trainer (masters and AdamW state in host RAM), takes one step, then saves
twice through `jaxzero.checkpoint.Checkpointer` (async): "blocked" is the time `save` holds the
training loop (the host snapshot), "write" the time until the checkpoint is committed; throughput
counts the bytes of masters + optimizer state. A blocking save (checkpoint.async_save=false) is
timed too. Prints one JSON line per save and a table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time

import jax
import numpy as np

from jaxzero.checkpoint import Checkpointer, make_meta
from jaxzero.config import TrainConfig
from jaxzero.overrides import apply_overrides
from jaxzero.trainer import build_trainer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.4b-bench")
    ap.add_argument("--dir", default="/tmp/jaxzero-bench-ckpt")
    ap.add_argument("--seq", type=int, default=2048)
    args = ap.parse_args()
    jax.config.update("jax_threefry_gpu_kernel_lowering", True)
    over = {
        "model.name": args.model,
        "data.seq_len": str(args.seq),
        "data.batch_size": "2",
        "steps": "10",
        "offload.optimizer": "cpu",
        "offload.params": "cpu",
        "data.source": "synthetic",
    }
    cfg = apply_overrides(TrainConfig(), over)
    trainer = build_trainer(cfg)
    state = trainer.init(jax.random.key(0))
    batch = np.zeros((1, 2, args.seq + 1), np.int32)
    state, m = trainer.step(state, trainer.put_batch(batch))
    jax.block_until_ready(m)
    saved = trainer.saved_state(state)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(saved))
    rows = []
    for i, async_save in enumerate((True, True, False)):
        shutil.rmtree(args.dir, ignore_errors=True)
        ck_cfg = apply_overrides(cfg, {"checkpoint.async_save": str(async_save)}).checkpoint
        ckpt = Checkpointer(args.dir, ck_cfg)
        meta = make_meta(i + 1, {"epoch": 0, "cursor": 0, "num_windows": 1}, cfg, trainer.layout, saved)
        t = time.perf_counter()
        ckpt.save(i + 1, saved, meta)
        blocked = time.perf_counter() - t
        ckpt.wait()  # host sync: until committed
        total = time.perf_counter() - t
        ckpt.close()
        row = {
            "async": async_save,
            "state_GB": nbytes / 1e9,
            "blocked_s": blocked,
            "committed_s": total,
            "write_GBps": nbytes / 1e9 / total,
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    shutil.rmtree(args.dir, ignore_errors=True)
    print(
        f"\n{args.model}: {nbytes / 1e9:.1f} GB of masters + optimizer state, "
        f"device {jax.devices()[0].device_kind}"
    )
    print(f"{'save':10} {'blocked s':>10} {'committed s':>12} {'GB/s':>6}")
    for r in rows:
        kind = "async" if r["async"] else "blocking"
        print(f"{kind:10} {r['blocked_s']:10.2f} {r['committed_s']:12.2f} {r['write_GBps']:6.2f}")


if __name__ == "__main__":
    main()

"""How long a checkpoint blocks training, how fast it is written, and what its checksums cost, for
host-resident offload state.

    python scripts/bench_checkpoint.py --model=llama-1b --dir=/tmp/ckpt

Builds the ZeRO-3 offload trainer (masters and AdamW state in host RAM), takes one step, then saves
through `jaxzero.storage.checkpoint.Checkpointer`, alternating saves with and without `checksums.json` (the
checksum pass runs inside Orbax's commit, so "committed" includes it): "blocked" is the time `save`
holds the training loop, "committed" the time until the checkpoint is final;
throughput counts the bytes of masters + optimizer state. A blocking save
(checkpoint.async_save=false) is timed too. Then restores the last checkpoint alternately with and
without `checkpoint.verify`. Prints one JSON line per measurement and a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import time

import jax
import numpy as np

from jaxzero.config import TrainConfig
from jaxzero.overrides import apply_overrides
from jaxzero.storage.checkpoint import Checkpointer
from jaxzero.storage.checkpoint_layout import make_meta
from jaxzero.trainer import build_trainer


class WithoutChecksums(Checkpointer):
    """The same saves without their checksum pass, for the side-by-side cost."""

    def _write_checksums(self, step_dir) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-1b")
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

    def record(what: str, blocked: float, total: float) -> None:  # one row of the table, printed as it comes
        row = {
            "what": what,
            "state_GB": nbytes / 1e9,
            "blocked_s": blocked,
            "done_s": total,
            "GBps": nbytes / 1e9 / total,
        }
        print(json.dumps(row), flush=True)
        rows.append(row)

    variants = [(True, True), (True, False), (True, True), (True, False), (False, True)]
    for i, (async_save, checksums) in enumerate(variants):
        shutil.rmtree(args.dir, ignore_errors=True)
        ck_cfg = dataclasses.replace(cfg.checkpoint, async_save=async_save)
        ckpt = (Checkpointer if checksums else WithoutChecksums)(args.dir, ck_cfg)
        meta = make_meta(i + 1, {"epoch": 0, "cursor": 0, "num_windows": 1}, cfg, trainer.layout, saved)
        t = time.perf_counter()
        ckpt.save(i + 1, saved, meta, trainer.fence)  # with the fence: asynchronous where configured
        blocked = time.perf_counter() - t
        ckpt.wait()  # host sync: until committed
        total = time.perf_counter() - t
        ckpt.close()
        has = (ckpt.directory / str(i + 1) / "checksums.json").is_file()
        assert has == checksums, (has, checksums)
        record(
            f"{'async' if async_save else 'blocking'} save{'' if checksums else ', no checksums'}",
            blocked,
            total,
        )
    last = len(variants)  # a checksummed checkpoint: restore it with and without verification
    abstract = trainer.abstract_saved_state()
    for verify in (False, True, False, True):
        ckpt = Checkpointer(args.dir, dataclasses.replace(cfg.checkpoint, verify=verify))
        t = time.perf_counter()
        restored = ckpt.restore(last, abstract, trainer.layout, cfg)
        jax.block_until_ready(restored.state)
        total = time.perf_counter() - t
        ckpt.close()
        del restored
        record(f"restore{', verified' if verify else ', unverified'}", total, total)
    shutil.rmtree(args.dir, ignore_errors=True)
    print(
        f"\n{args.model}: {nbytes / 1e9:.1f} GB of masters + optimizer state, "
        f"device {jax.devices()[0].device_kind}"
    )
    print(f"{'what':28} {'blocked s':>10} {'done s':>8} {'GB/s':>6}")
    for r in rows:
        print(f"{r['what']:28} {r['blocked_s']:10.2f} {r['done_s']:8.2f} {r['GBps']:6.2f}")


if __name__ == "__main__":
    main()

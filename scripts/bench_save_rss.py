"""Host RSS around checkpoint saves of an offloaded run, in one process: build the trainer as the
program does (`preflight.decide_before_jax`, then `build_trainer`), run 3 steps, then twice: save (blocking
until written), drop the saved state, collect, `malloc_trim`, 3 more steps; RSS (and its anonymous,
file and shared parts) printed after each. A save should leave RSS where it was: it copies the
accelerator's units one part at a time and keeps nothing.

    python scripts/bench_save_rss.py                                   # the 3.37B model, ZeRO-3
    python scripts/bench_save_rss.py optimizer.state_dtype=float32 offload.device_state_units=0

Arguments are config overrides (key=value) over the defaults below. Checkpoints go to /tmp/save-rss.
"""

from __future__ import annotations

import ctypes
import gc
import shutil
import sys
import time

from jaxzero.config import TrainConfig
from jaxzero.overrides import apply_overrides
from jaxzero.planner import preflight

DEFAULTS = {
    "model.name": "llama-3.4b-bench",
    "data.source": "synthetic",
    "data.seq_len": "2048",
    "data.batch_size": "8",
    "optimizer.state_dtype": "bfloat16",
    "offload.optimizer": "cpu",
    "offload.params": "cpu",
    "checkpoint.enabled": "true",
    "checkpoint.keep": "1",
    "run_dir": "/tmp/save-rss",
    "steps": "100",
}


def rss() -> dict[str, float]:
    """This process's resident set and its parts, GiB."""
    lines = open("/proc/self/status").read().splitlines()
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    return {
        k: round(int(fields[k].split()[0]) / 2**20, 2) for k in ("VmRSS", "RssAnon", "RssFile", "RssShmem")
    }


def main() -> None:
    cfg = apply_overrides(TrainConfig(), {**DEFAULTS, **dict(kv.split("=", 1) for kv in sys.argv[1:])})
    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    decision = preflight.decide_before_jax(cfg)  # before JAX starts: sizes XLA's pinned pool for it
    import jax

    from jaxzero.data import DataShard, build_data
    from jaxzero.storage.checkpoint import Checkpointer
    from jaxzero.trainer import build_trainer

    trainer = build_trainer(decision.config, decision=decision)
    print("plan:", trainer.plan.describe(cfg.optimizer.name, "the accelerator"), flush=True)
    batches = build_data(cfg.data, cfg.model.vocab_size, cfg.seed, DataShard(0, 1)).train_iter()
    state = trainer.init(jax.random.key(0))

    def steps(state, n: int):
        for _ in range(n):
            state, m = trainer.step(state, trainer.put_batch(next(batches)))
            float(jax.device_get(m.loss))  # host sync
        jax.block_until_ready(state)  # host sync: the host updates too
        time.sleep(1)
        return state

    state = steps(state, 3)
    print("after 3 steps", rss(), flush=True)
    ckpt = Checkpointer(cfg.run_dir, decision.config.checkpoint)
    for k in range(2):
        saved = trainer.saved_state(state)
        ckpt.save(3 * (k + 1), saved, {"probe": k}, trainer.fence)
        ckpt.wait()  # host sync: the save is written
        print(f"save {k}: written", rss(), flush=True)
        del saved
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        print(f"save {k}: dropped, collected, trimmed", rss(), flush=True)
        state = steps(state, 3)
        print(f"save {k}: 3 steps later", rss(), flush=True)
    ckpt.close()
    shutil.rmtree(cfg.run_dir, ignore_errors=True)


if __name__ == "__main__":
    main()

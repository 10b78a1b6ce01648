"""Host RAM a checkpoint save and a restore add, measured in a fresh process: prints one JSON line.

    python tests/programs/checkpoint_rss.py MODE RUN_DIR [--a.b=v ...]

MODE: `blocking` (the save alone), `async` (the save while steps run, against the same steps
without one), or `restore` (of the newest checkpoint in RUN_DIR, in this fresh process). Saves
follow a warm-up save (Orbax's and TensorStore's one-time set-up is not a save's cost). Then the
peak RSS (`VmHWM`, reset through `/proc/self/clear_refs`) over the RSS before:

    save      the save's peak over the RSS before it (blocking), or the steps' peak with the save
              over the steps' peak without it (async)
    restore   the restore's peak over the RSS before it plus the restored state's host bytes
    state     bytes of the saved state; unit: bytes of its largest unit; buffer: checkpoint.buffer_gib
"""

import gc
import json
import sys
import time

import jax
import numpy as np

from jaxzero.config import TrainConfig
from jaxzero.overrides import apply_overrides
from jaxzero.plan import placement
from jaxzero.storage import checkpoint as checkpoint_lib
from jaxzero.storage import checkpoint_layout
from jaxzero.trainer import build_trainer


def status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def reset_peak() -> int:
    """Reset the peak RSS to the RSS now; returns the RSS now."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status("VmRSS")


def steps(trainer, state, first: int, last: int):
    d = trainer.config.data
    for k in range(first, last + 1):
        batch = np.random.default_rng(k).integers(
            0, trainer.config.model.vocab_size, (1, d.batch_size, d.seq_len + 1)
        )
        state, m = trainer.step(state, trainer.put_batch(batch.astype(np.int32)))
        jax.block_until_ready(m.loss)  # host sync: the step's work is done (its host update may still run)
    return state


def restore(run_dir: str, cfg: TrainConfig) -> None:
    """The restore of the newest checkpoint in a fresh process, into a state the trainer can step:
    its peak RSS over the RSS before (compare with `init`'s: the state itself)."""
    trainer = build_trainer(cfg, placement.make_mesh(jax.devices()[:1]))
    abstract = trainer.abstract_saved_state()
    largest = checkpoint_layout.largest_array_bytes(abstract)
    ckpt = checkpoint_lib.Checkpointer(run_dir, cfg.checkpoint, largest_array=largest)
    step = ckpt.steps()[-1]
    before = reset_peak()
    restored = ckpt.restore(step, abstract, trainer.layout, cfg)
    state = trainer.from_saved_state(restored.state)
    del restored
    ckpt.close()
    jax.block_until_ready(jax.tree.leaves(trainer.saved_state(state)["params"].blocks))
    print(json.dumps({"restore": status("VmHWM") - before, "state": checkpoint_layout.state_bytes(abstract)}))
    trainer.close()


def init(cfg: TrainConfig) -> None:
    """The RSS a fresh state of the run takes in a fresh process, over the RSS before it."""
    trainer = build_trainer(cfg, placement.make_mesh(jax.devices()[:1]))
    before = reset_peak()
    state = trainer.init(jax.random.key(0))
    jax.block_until_ready(jax.tree.leaves(trainer.saved_state(state)["params"].blocks))
    print(json.dumps({"init": status("VmHWM") - before}))
    trainer.close()


def main() -> None:
    mode, run_dir, *overrides = sys.argv[1:]
    cfg = apply_overrides(TrainConfig(), dict(o.removeprefix("--").split("=", 1) for o in overrides))
    if mode == "restore":
        return restore(run_dir, cfg)
    if mode == "init":
        return init(cfg)
    trainer = build_trainer(cfg, placement.make_mesh(jax.devices()[:1]))
    state = steps(trainer, trainer.init(jax.random.key(0)), 1, 1)
    ckpt = checkpoint_lib.Checkpointer(run_dir, cfg.checkpoint)

    def save(step: int, state) -> None:
        saved = trainer.saved_state(state)
        meta = checkpoint_layout.make_meta(
            step, {"epoch": 0, "cursor": 0, "num_windows": 1}, cfg, trainer.layout, saved
        )
        ckpt.save(step, saved, meta, trainer.fence)
        del saved

    save(1, state)  # warm-up
    ckpt.wait()
    abstract = trainer.abstract_saved_state()
    units = checkpoint_layout.state_parts(abstract)[1:]
    result = {
        "state": checkpoint_layout.state_bytes(abstract),
        "unit": max(checkpoint_layout.state_bytes(p.tree) for p in units),
        "buffer": checkpoint_lib.buffer_bytes(cfg.checkpoint),
    }
    if mode == "blocking":
        before = reset_peak()
        save(2, state)
        result["save"] = status("VmHWM") - before
    else:
        state = steps(trainer, state, 2, 2)  # the steps' own peak, without a save
        reset_peak()
        state = steps(trainer, state, 3, 5)
        without = status("VmHWM")
        reset_peak()
        t0 = time.perf_counter()
        save(5, state)
        returned = time.perf_counter() - t0
        state = steps(trainer, state, 6, 8)
        ckpt.wait()
        result["save"] = status("VmHWM") - without
        result["returned_s"] = returned
    ckpt.close()
    trainer.saved_state(state)  # host sync: the last step's host updates are done
    trainer.close()
    print(json.dumps(result))


if __name__ == "__main__":
    main()

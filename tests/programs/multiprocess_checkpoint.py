"""One of two CPU processes on loopback (jax.distributed, gloo collectives) that train a step on a
2-device mesh spanning both, save one Orbax checkpoint together and restore it.

    python multiprocess_checkpoint.py PORT PROCESS_ID RUN_DIR      (run by tests/test_multiprocess.py)
"""

import sys

import jax
import numpy as np

from jaxzero.config import TrainConfig
from jaxzero.overrides import apply_overrides
from jaxzero.plan import placement
from jaxzero.storage.checkpoint import Checkpointer
from jaxzero.storage.checkpoint_layout import make_meta
from jaxzero.trainer import build_trainer


def main(port: str, pid: int, run_dir: str) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    cfg = apply_overrides(
        TrainConfig(), {"model.num_layers": "2", "data.seq_len": "32", "data.batch_size": "4"}
    )
    mesh = placement.make_mesh(jax.devices())  # global devices: one per process
    trainer = build_trainer(cfg, mesh)
    state = trainer.init(jax.random.key(0))
    tokens = np.random.default_rng(0).integers(0, 256, (1, 4, 33)).astype(np.int32)
    batch = jax.make_array_from_callback(
        tokens.shape, placement.train_batch_sharding(mesh), lambda i: tokens[i]
    )
    state, metrics = trainer.step(state, batch)
    ckpt = Checkpointer(run_dir, cfg.checkpoint)
    saved = trainer.saved_state(state)
    ckpt.save(1, saved, make_meta(1, {"epoch": 0, "cursor": 0, "num_windows": 1}, cfg, trainer.layout, saved))
    ckpt.wait()
    restored = trainer.from_saved_state(
        ckpt.restore(1, trainer.abstract_saved_state(), trainer.layout, cfg).state
    )
    ckpt.close()
    equal = all(
        np.array_equal(np.asarray(a.addressable_data(0)), np.asarray(b.addressable_data(0)))
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored))
    )
    loss = float(metrics.loss.addressable_data(0))
    print(f"process {pid}: devices {jax.device_count()} loss {loss:.6f} restored_equal {equal}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])

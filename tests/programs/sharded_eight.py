"""ZeRO-3 offload over 8 fake CPU devices against one device: the program `tests/test_sharded.py` runs
in a process of its own (`XLA_FLAGS=--xla_force_host_platform_device_count=8`; the suite's other
processes have 4). Exits 0 when the 8-device run matches within test_sharded's fixed tolerances."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the sharded test's helpers

import jax  # noqa: E402
from test_sharded import OFFLOAD, assert_matches, run, tiny  # noqa: E402

assert jax.device_count() == 8, jax.devices()
for family in ("llama", "gpt2"):
    _, ref_state, ref_losses, ref_norms, ref_val = run(tiny(family), devices=1)
    trainer, state, losses, norms, val = run(tiny(family, **OFFLOAD["params"]), devices=8)
    assert trainer.mesh.size == 8 and trainer.plan.zero_stage == 3
    assert_matches((state, losses, norms, val), (ref_state, ref_losses, ref_norms, ref_val))
    print(family, "8 devices == 1 device")

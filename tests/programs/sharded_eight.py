"""ZeRO-3 offload over 8 fake CPU devices against one device: the program `tests/test_sharded.py` runs
in a process of its own (`XLA_FLAGS=--xla_force_host_platform_device_count=8`; the suite's other
processes have 4). Exits 0 when the 8-device run matches within test_sharded's fixed tolerances."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the sharded test's helpers

import jax  # noqa: E402
import numpy as np  # noqa: E402
from test_sharded import LOSS_TOL, OFFLOAD, PARAM_TOL, rel, run, tiny  # noqa: E402

assert jax.device_count() == 8, jax.devices()
for family in ("llama", "gpt2"):
    _, ref_state, ref_losses, ref_norms, ref_val = run(tiny(family), devices=1)
    trainer, state, losses, norms, val = run(tiny(family, **OFFLOAD["params"]), devices=8)
    assert trainer.mesh.size == 8 and trainer.plan.zero_stage == 3
    np.testing.assert_allclose(losses, ref_losses, atol=LOSS_TOL, rtol=0)
    np.testing.assert_allclose(norms, ref_norms, rtol=PARAM_TOL)
    assert abs(val - ref_val) < LOSS_TOL
    params, ref_params = jax.device_get(state.params), jax.device_get(ref_state.params)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(ref_params)):
        name = jax.tree_util.keystr(path)
        if name.endswith("['c_attn']['bias']"):  # drop the key third: see test_offload.py's docstring
            d = a.shape[0] // 3
            a, b = np.concatenate([a[:d], a[2 * d :]]), np.concatenate([b[:d], b[2 * d :]])
        assert rel(a, b) < PARAM_TOL, name
    print(family, "8 devices == 1 device")

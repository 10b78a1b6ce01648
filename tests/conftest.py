"""Test setup: 4 fake CPU devices (set before JAX starts), strict numerics, float64 available.

Tests that need one device build a mesh of `jax.devices()[:1]`; sharded == unsharded tests compare a
mesh over all 4 devices with that one.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)  # for float64 NumPy-reference comparisons; dtypes stay explicit
jax.config.update("jax_numpy_rank_promotion", "raise")

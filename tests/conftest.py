"""Test setup: 4 fake CPU devices (set before JAX starts), strict rank promotion.

Float64 references are computed in NumPy; JAX runs in its production (32-bit) mode.

Tests that need one device build a mesh of `jax.devices()[:1]`; sharded == unsharded tests compare a
mesh over all 4 devices with that one.
"""

import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

# Trainers built by different tests compile identical programs (same shapes, fresh closures); a
# persistent compilation cache shared by the session turns the repeats into cache hits.
# The programs tests start share it (subprocess_run.COMPILATION_CACHE).
sys.path.insert(0, os.path.dirname(__file__))
from subprocess_run import COMPILATION_CACHE  # noqa: E402

jax.config.update("jax_compilation_cache_dir", COMPILATION_CACHE["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

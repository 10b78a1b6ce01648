"""Which collectives XLA compiled into the offload engine's per-block programs over a mesh.

Builds a ZeRO-3 offload trainer over every visible device, compiles one block's forward and
rematerialised backward for one micro-batch, and prints each collective with its operand shapes:
the weights should be all-gathered once per leaf in both programs, and the gradients reduce-
scattered (or all-reduced, then sliced) once per leaf in the backward. Compiles only; no step runs.

    python scripts/mesh_collectives.py --model=llama-3.4b-bench --batch_per_gpu=8 --seq=2048
    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu python scripts/mesh_collectives.py
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

import jax
import jax.numpy as jnp

from jaxzero.config import TrainConfig
from jaxzero.models import build_model
from jaxzero.offload.streaming import StreamedModel
from jaxzero.overrides import apply_overrides
from jaxzero.plan import placement, resolve_plan

# `%name = SHAPE op(`: SHAPE one shape, or the (tuple, of, shapes) of collectives XLA combined
COLLECTIVE = re.compile(
    r"= (\(.*?\)|\S+) (all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute)(-start)?\("
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-tiny")
    ap.add_argument("--batch_per_gpu", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    mesh = placement.make_mesh()
    over = {
        "model.name": args.model,
        "data.seq_len": str(args.seq),
        "data.batch_size": str(args.batch_per_gpu * mesh.size),
        "data.grad_accum": "1",
        "offload.optimizer": "cpu",
        "offload.params": "cpu",
        **dict(kv.split("=", 1) for kv in args.set),
    }
    cfg = apply_overrides(TrainConfig(), over)
    model = build_model(cfg.model)
    where = placement.offload_placement(mesh, resolve_plan(cfg))
    streamed = StreamedModel(model, where, 1)
    dtype = jnp.dtype(cfg.model.compute_dtype)
    block = jax.eval_shape(model.init, jax.random.key(0)).blocks[0]
    w = jax.tree.map(lambda s, t: jax.ShapeDtypeStruct(s.shape, dtype, sharding=t), block, streamed._copy_in)
    rows = placement.batch_rows_sharding(mesh, 4)
    x = jax.ShapeDtypeStruct(
        (1, cfg.data.batch_size, cfg.data.seq_len, cfg.model.hidden_size), dtype, sharding=rows
    )
    print(f"{cfg.model.name}, {mesh.size} x {mesh.devices.flat[0].device_kind}, {cfg.model.compute_dtype}")
    for name, fn, operands in (
        ("block forward", streamed._block_fwd, (w, x)),
        ("block backward", streamed._block_bwd, (w, x, x)),
    ):
        text = fn.lower(*operands).compile().as_text()
        found = Counter((op, shape) for shape, op, _ in COLLECTIVE.findall(text))
        print(f"{name}: {sum(found.values())} collectives")
        for (op, shape), n in sorted(found.items()):
            print(f"  {n:3d} x {op:16s} {shape[:100]}")


if __name__ == "__main__":
    main()

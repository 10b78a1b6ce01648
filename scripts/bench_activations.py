"""What the accelerator holds while one unit's backward runs: XLA's own figures, compiled, not run.

For each model and micro-batch, compiles the two largest transient phases of a step: a block's
rematerialised backward (recompute + vjp) and the head's loss + vjp, written here as the bodies of
`UnitPrograms.block_bwd` and `UnitPrograms.head_grad` (its loss in pieces where the engine's
is: `objective.head_loss`) for one micro-batch on one device (without
their mesh constraints, which one device does not need). `memory_analysis()` of each
compiled program gives its temporary buffers (the transient activations the memory plan estimates),
its arguments and its outputs. Nothing is allocated on the device; the figures are what the compiler
planned, for the device the script runs on.

    python scripts/bench_activations.py --models=llama-3.4b-bench,llama-7b,llama-13b --tokens=16384,32768

Prints one table and writes `bench_activations.json` under --out, with the memory plan's estimate of
the same terms beside each figure.
"""

from __future__ import annotations

import argparse
import json
import os


def measure(name: str, tokens: int, seq: int) -> dict:
    import jax
    import jax.numpy as jnp

    from jaxzero.config import ModelConfig
    from jaxzero.models import build_model
    from jaxzero.numerics.objective import head_loss
    from jaxzero.planner.memory import GiB, transient_activations

    seq = seq or tokens  # 0: one sequence of all the tokens
    mcfg = ModelConfig.named(name)
    model = build_model(mcfg)
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    dtype = jnp.dtype(mcfg.compute_dtype)
    cast = lambda t: jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), t)  # noqa: E731
    mb = tokens // seq
    x = jax.ShapeDtypeStruct((mb, seq, mcfg.hidden_size), dtype)
    window = jax.ShapeDtypeStruct((mb, seq + 1), jnp.int32)

    def block_bwd(w, xa, dya):  # UnitPrograms.block_bwd with one micro-batch
        _, vjp = jax.vjp(model.block, w, xa)
        return vjp(dya)

    def head_grad(hw, ew, xa, wa):  # UnitPrograms.head_grad's per-micro-batch body
        def f(hw, ew, xa):
            return head_loss(model, hw, ew, xa, wa, jnp.float32(1.0 / wa[:, 1:].size))

        loss, vjp = jax.vjp(f, hw, ew, xa)
        return loss, vjp(jnp.float32(1.0))

    out = {"model": name, "tokens": tokens, "seq": seq, "device": jax.devices()[0].device_kind}
    for phase, fn, args in (
        ("block_bwd", jax.jit(block_bwd, donate_argnums=(2,)), (cast(shapes.blocks[0]), x, x)),
        ("head_grad", jax.jit(head_grad), (cast(shapes.head), cast(shapes.embed), x, window)),
    ):
        ma = fn.lower(*args).compile().memory_analysis()
        out[phase] = {
            "temp_gib": ma.temp_size_in_bytes / GiB,
            "args_gib": ma.argument_size_in_bytes / GiB,
            "out_gib": ma.output_size_in_bytes / GiB,
        }
    plan = transient_activations(mcfg, tokens, seq)
    out["plan_block_gib"], out["plan_head_gib"] = plan.block / GiB, plan.head / GiB
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama-3.4b-bench,llama-7b,llama-13b,llama-20b")
    ap.add_argument("--tokens", default="16384,32768", help="tokens per micro-batch and device")
    ap.add_argument("--seq", type=int, default=2048, help="sequence length; 0: one sequence per micro-batch")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    rows = [measure(m, int(t), args.seq) for m in args.models.split(",") for t in args.tokens.split(",")]
    with open(os.path.join(args.out, "bench_activations.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"device {rows[0]['device']}, seq {args.seq}; GiB (compiled temporaries; the plan's estimate)")
    print(f"{'model':18} {'tokens':>7} {'block bwd temp':>15} {'plan':>6} {'head temp':>10} {'plan':>6}")
    for r in rows:
        b, h = r["block_bwd"], r["head_grad"]
        print(
            f"{r['model']:18} {r['tokens']:7d} {b['temp_gib']:15.2f} {r['plan_block_gib']:6.2f} "
            f"{h['temp_gib']:10.2f} {r['plan_head_gib']:6.2f}   (block args {b['args_gib']:.2f} "
            f"out {b['out_gib']:.2f}; head args {h['args_gib']:.2f} out {h['out_gib']:.2f})"
        )


if __name__ == "__main__":
    main()

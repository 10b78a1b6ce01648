"""Host RAM a blocking checkpoint save takes above the arrays it writes, for arrays of the CPU backend
(host state): Orbax copies what it writes, and `jaxzero.checkpoint` bounds those copies by batches.

    python scripts/bench_save_copies.py --repeats=5

Each run is a fresh process (an allocator keeps what an earlier save freed) that puts 4 float32
arrays of 0.5 GB on the CPU backend, resets its peak RSS (`/proc/self/clear_refs`) and saves them
once, blocking, in one of these ways, then reports how far the peak rose above the RSS before:

    orbax          Orbax's standard handler, the 4 arrays alone
    pytree         Orbax's PyTree handler, the 4 arrays alone
    standard-step  Orbax's standard handler, with an int32 step scalar beside them: as
                   `jaxzero.checkpoint` saved before batches
    unbatched      `Checkpointer` (the step scalar beside them) with no array streamed
    batch=B        `Checkpointer` streaming every array, `TRANSFER_BYTES` = B bytes
    (a suffix -nosum: without the checksum pass)

Linux only. Prints the range over the repeats per way.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile

GB = 1e9


def one(way: str, directory: str) -> float:
    """One save `way`; the peak RSS above the RSS before it, in GB."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    from jaxzero import checkpoint as ck
    from jaxzero.config import CheckpointConfig

    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

    host = jax.devices("cpu")[0]
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(125_000_000, dtype=np.float32) for _ in range(4)]  # 0.5 GB each
    tree = {f"a{i}": jax.device_put(a, host) for i, a in enumerate(arrays)}
    del arrays
    jax.block_until_ready(tree)
    if way == "orbax":
        options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False, create=True)
        manager = ocp.CheckpointManager(directory, options=options)
        save = lambda: manager.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(tree)))  # noqa: E731
    elif way == "pytree":
        options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False, create=True)
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        registry.add("state", ocp.args.PyTreeSave, ocp.PyTreeCheckpointHandler())
        manager = ocp.CheckpointManager(directory, options=options, handler_registry=registry)
        save = lambda: manager.save(1, args=ocp.args.Composite(state=ocp.args.PyTreeSave(tree)))  # noqa: E731
    elif way == "standard-step":
        options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False, create=True)
        manager = ocp.CheckpointManager(directory, options=options)
        state = {"step": jax.device_put(np.int32(1), host), "params": tree}
        save = lambda: manager.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))  # noqa: E731
    else:
        if way.startswith("unbatched"):
            ck.streamed_keys = lambda t: frozenset()
        else:
            ck.TRANSFER_BYTES = int(float(way.split("=")[1].removesuffix("-nosum")))
        manager = ck.Checkpointer(directory, CheckpointConfig(async_save=False))
        if way.endswith("-nosum"):
            manager._write_checksums = lambda: None
        state = {"step": jax.device_put(np.int32(1), host), "params": tree}
        save = lambda: manager.save(1, state, {"step": 1})  # noqa: E731
    before = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    save()
    manager.close()
    return (status("VmHWM") - before) / GB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ways", default="orbax,pytree,standard-step,unbatched,batch=2e9,batch=6e8")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a child's way
    args = ap.parse_args()
    if args.one:
        directory = tempfile.mkdtemp(prefix="jaxzero-save-copies-")
        try:
            print(one(args.one, directory))
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        return
    print(f"{'way':12} {'GB over the RSS before the save: min - max':>44}")
    for way in args.ways.split(","):
        runs = []
        for _ in range(args.repeats):
            out = subprocess.run([sys.executable, __file__, f"--one={way}"], capture_output=True, text=True)
            if out.returncode:
                sys.exit(out.stderr[-3000:])
            runs.append(float(out.stdout.split()[-1]))
        print(f"{way:12} {min(runs):21.2f} - {max(runs):.2f}   ({', '.join(f'{r:.2f}' for r in runs)})")


if __name__ == "__main__":
    main()

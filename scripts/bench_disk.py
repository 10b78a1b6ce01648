"""The disk tier's own bandwidth: what `jaxzero.offload.disk.DiskStore` reaches on a directory.

Creates `--units` unit files of `--gib` GiB each, then times three phases through the store exactly as
the offload engine drives it: writes alone (creating the files), reads alone (each unit read and
handed back unchanged), and a step's pattern (each unit read, then written back while the next is
read). Prints GB/s per phase, reads and writes together, and whether direct I/O was in use.

    python scripts/bench_disk.py --dir=/tmp/jaxzero-disk --units=4 --gib=3
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from jaxzero.offload.disk import DiskStore


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--units", type=int, default=4)
    ap.add_argument("--gib", type=float, default=3.0)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    n = int(args.gib * 2**30) // 4
    positions = list(range(args.units))
    store = DiskStore(args.dir, positions, args.slots)
    rows = []
    try:
        tree = (np.ones(n, np.float32),)
        t = time.perf_counter()
        for p in positions:
            store.create(p, tree)
        rows.append(("write", args.units * n * 4, time.perf_counter() - t))
        del tree
        for phase in ("read", "read + write back"):
            t = time.perf_counter()
            for _ in range(args.rounds):
                store.schedule()
                for p in positions:
                    store.take(p)
                    if phase == "read":
                        store.give_back(p)
                    else:
                        store.put(p)
            for p in positions:
                store._settled(p)  # the last write-backs
            moved = args.rounds * args.units * n * 4 * (1 if phase == "read" else 2)
            rows.append((phase, moved, time.perf_counter() - t))
        print(
            f"directory {store.directory.parent}, direct I/O: {store.direct}, "
            f"{args.units} units of {args.gib} GiB"
        )
        print(f"{'phase':<20} {'GB':>8} {'s':>8} {'GB/s':>8}")
        for name, nbytes, s in rows:
            print(f"{name:<20} {nbytes / 1e9:>8.1f} {s:>8.2f} {nbytes / 1e9 / s:>8.2f}")
    finally:
        store.close()


if __name__ == "__main__":
    main()

"""`python -m jaxzero.plot RUN_DIR [RUN_DIR ...] [--out=DIR]`: PNG figures of training runs, several
runs overlaid for comparison, each one colour labelled by its directory name.

Reads each run's `metrics.jsonl` (and `config.json` where the records do not say how many tokens a
step trains on) and writes into `--out` (default `<first RUN_DIR>/plots/`):

    loss.png        training loss (lines) and validation loss (dashed, dots) against the step, and
                    against the tokens trained on
    throughput.png  tokens/s and model TFLOP/s against the step (MFU too, where a peak is known)
    breakdown.png   offloaded runs only, one panel per run: for each logged step, stacked bars of where
                    its time went, seconds per step: the accelerator (compute, idle), the host (update,
                    idle), the copies (H2D, D2H, disk) and the waits (for the host, for the disk)

Nothing else is written, and `--out` is refused if it holds files of another origin. Needs matplotlib:
`pip install 'jaxzero[plot]'`. Exit codes: 0 done, 2 a run that cannot be read, an `--out` refused,
or matplotlib missing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from jaxzero.state import BREAKDOWN_DISK, BREAKDOWN_TIMES
from jaxzero.storage.run_dir import CONFIG_FILE, METRICS_FILE, PLOTS_DIR

FIGURES = ("loss.png", "throughput.png", "breakdown.png")  # all this tool ever writes
# The breakdown's bars, one per lane and logged step. Within the first two lanes the parts add up to
# the step's wall time; copies and waits run alongside them (busy times), so they get bars of their own.
LANES = (
    ("accelerator", ("gpu_compute_s", "gpu_idle_s")),
    ("host", ("host_update_s", "host_idle_s")),
    ("copies", ("h2d_s", "d2h_s", "disk_read_s", "disk_write_s")),
    ("waits", ("wait_weights_s", "wait_disk_s")),
)
# One hue per lane (matplotlib's tab20 pairs), the lighter shade for its second part: idle time pale.
COLOURS = {
    "gpu_compute_s": "#1f77b4",
    "gpu_idle_s": "#aec7e8",
    "host_update_s": "#ff7f0e",
    "host_idle_s": "#ffbb78",
    "h2d_s": "#2ca02c",
    "d2h_s": "#98df8a",
    "disk_read_s": "#bcbd22",
    "disk_write_s": "#dbdb8d",
    "wait_weights_s": "#d62728",
    "wait_disk_s": "#ff9896",
}
# The console's labels; records do not say which accelerator ran them.
LABELS = {k.key: k.label.format(device="accelerator") for k in BREAKDOWN_TIMES + BREAKDOWN_DISK}
MAX_BARS = 40  # logged steps per breakdown panel, evenly spaced: more bars than that are unreadable


class PlotError(Exception):
    """A run that cannot be read or an output directory that must not be written; exit code 2."""


class RunRecords:
    """One run directory's records, one per logged step, and its label."""

    def __init__(self, path: Path, records: list[dict[str, Any]], tokens_per_step: int | None):
        self.path, self.records, self.tokens_per_step = path, records, tokens_per_step
        self.label = path.name

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of the records where `key` is a number."""
        pairs = [(r["step"], r[key]) for r in self.records if isinstance(r.get(key), int | float)]
        return [s for s, _ in pairs], [v for _, v in pairs]


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a `metrics.jsonl`, by step. A line that is not a JSON record is an error naming
    the file and line, except a last line cut short (no newline): a killed run can leave one."""
    text = path.read_text()
    lines = text.splitlines()
    by_step: dict[int, dict[str, Any]] = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as e:
            if n == len(lines) and not text.endswith("\n"):
                print(f"jaxzero.plot: {path}:{n}: skipped a truncated last line", file=sys.stderr)
                continue
            raise PlotError(f"{path}:{n} is not JSON ({e.msg}): {line[:80]!r}") from e
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
            raise PlotError(f"{path}:{n} is not a metrics record (a JSON object with an integer step)")
        by_step[rec["step"]] = rec  # a step logged twice (a resumed run redoes it): the later one
    return [by_step[s] for s in sorted(by_step)]


def tokens_per_step(run_dir: Path, records: list[dict[str, Any]]) -> int | None:
    """Tokens one step trains on: a record's `loss_tokens + masked_tokens`, else batch_size x seq_len
    from `config.json`; None if neither says."""
    for r in records:
        if isinstance(r.get("loss_tokens"), int) and isinstance(r.get("masked_tokens"), int):
            return r["loss_tokens"] + r["masked_tokens"]
    try:
        data = json.loads((run_dir / CONFIG_FILE).read_text())["data"]
        return int(data["batch_size"]) * int(data["seq_len"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_run(arg: str) -> RunRecords:
    """The run in directory `arg`; PlotError if it is missing, has no records, or a line is bad."""
    path = Path(arg)
    if not path.is_dir():
        raise PlotError(f"run directory {arg!r} " + ("is a file" if path.exists() else "does not exist"))
    metrics = path / METRICS_FILE
    if not metrics.is_file():
        raise PlotError(f"{metrics} does not exist: {arg!r} is not a jaxzero run directory")
    records = read_metrics(metrics)
    if not records:
        raise PlotError(f"{metrics} holds no records yet (nothing logged)")
    return RunRecords(path.resolve(), records, tokens_per_step(path, records))


def prepare_out(out: Path) -> None:
    """Create `out` (not its parents) or check that it holds only figures this tool writes: it
    overwrites its own files and nothing else."""
    if out.exists():
        if not out.is_dir():
            raise PlotError(f"--out {str(out)!r} is a file; pass a directory")
        foreign = sorted(p.name for p in out.iterdir() if p.name not in FIGURES)
        if foreign:
            raise PlotError(
                f"--out {str(out)!r} holds files jaxzero.plot did not write ({', '.join(foreign[:5])}); "
                "pass a new or empty directory"
            )
        return
    if not out.parent.is_dir():
        raise PlotError(f"--out {str(out)!r}: its parent directory does not exist")
    out.mkdir()


def plot_loss(plt: Any, runs: list[RunRecords], path: Path) -> None:
    """Training and validation loss against the step (left) and the tokens trained on (right)."""
    fig, (by_step, by_tokens) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for i, run in enumerate(runs):
        colour = f"C{i % 10}"
        for key, style in (("loss", {"linestyle": "-"}), ("val_loss", {"linestyle": "--", "marker": "o"})):
            steps, values = run.series(key)
            label = f"{run.label} {'val' if key == 'val_loss' else 'train'}"
            by_step.plot(steps, values, color=colour, label=label, **style)
            if run.tokens_per_step:
                tokens = [s * run.tokens_per_step for s in steps]
                by_tokens.plot(tokens, values, color=colour, label=label, **style)
    by_step.set(xlabel="step", ylabel="loss", title="loss by step")
    by_tokens.set(xlabel="tokens", title="loss by tokens trained on")
    for ax in (by_step, by_tokens):
        ax.grid(alpha=0.3)
    by_step.legend(fontsize="small")
    save(fig, path)


def plot_throughput(plt: Any, runs: list[RunRecords], path: Path) -> None:
    """tokens/s and TFLOP/s against the step, and MFU where any run has it (CPUs have no peak)."""
    panels = [("tokens_per_s", "tokens/s"), ("tflops", "model TFLOP/s")]
    if any(run.series("mfu")[0] for run in runs):
        panels.append(("mfu", "MFU"))
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 3 * len(panels)), sharex=True, squeeze=False)
    for ax, (key, name) in zip(axes[:, 0], panels):
        for i, run in enumerate(runs):
            steps, values = run.series(key)  # the first record has none: it includes compilation
            ax.plot(steps, values, color=f"C{i % 10}", marker=".", label=run.label)
        ax.set(ylabel=name)
        ax.grid(alpha=0.3)
    axes[0, 0].set_title("throughput (each record: the steps since the one before)")
    axes[0, 0].legend(fontsize="small")
    axes[-1, 0].set_xlabel("step")
    save(fig, path)


def plot_breakdown(plt: Any, runs: list[RunRecords], path: Path) -> None:
    """One panel per run: for each logged step a bar per lane (`LANES`), stacked by its parts."""
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 4 * len(runs)), squeeze=False)
    for ax, run in zip(axes[:, 0], runs):
        records = [r for r in run.records if isinstance(r.get("step_s"), int | float)]
        records = records[:: -(-len(records) // MAX_BARS)]  # every k-th: at most MAX_BARS bars
        # Parts absent or zero at every step (no disk units, nothing waited) are left out.
        lanes = [(n, [k for k in ks if any(r.get(k) for r in records)]) for n, ks in LANES]
        lanes = [(n, ks) for n, ks in lanes if ks]
        width = 0.8 / len(lanes)
        for j, (lane, keys) in enumerate(lanes):
            x = [i + (j - (len(lanes) - 1) / 2) * width for i in range(len(records))]
            bottom = [0.0] * len(records)
            for key in keys:
                values = [float(r.get(key) or 0.0) for r in records]
                label = LABELS[key] if LABELS[key].startswith(lane) else f"{lane}: {LABELS[key]}"
                ax.bar(x, values, width, bottom=bottom, color=COLOURS[key], label=label)
                bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_xticks(range(len(records)), [str(r["step"]) for r in records])
        names = " | ".join(n for n, _ in lanes)
        ax.set(title=run.label, ylabel="seconds per step", xlabel=f"step (bars left to right: {names})")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.01, 0.5))
    save(fig, path)


def save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _unwritable(out: Path, error: OSError) -> int:
    print(f"jaxzero.plot: error: cannot write the figures into {str(out)!r}: {error}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m jaxzero.plot",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a training run directory")
    ap.add_argument("--out", default=None, help="where the PNGs go (default: <first RUN_DIR>/plots)")
    args = ap.parse_args(argv)
    try:
        import matplotlib  # optional (jaxzero[plot]): only plotting needs it
    except ImportError:
        print("jaxzero.plot: error: matplotlib is missing: pip install 'jaxzero[plot]'", file=sys.stderr)
        return 2
    matplotlib.use("Agg")  # files only: no display needed, none opened
    import matplotlib.pyplot as plt  # optional (jaxzero[plot]), after the backend is chosen

    try:
        runs = [load_run(a) for a in args.run_dirs]
        out = Path(args.out) if args.out else Path(args.run_dirs[0]) / PLOTS_DIR
        prepare_out(out)
    except PlotError as e:
        print(f"jaxzero.plot: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # --out cannot be created (read-only, no permission): one line
        return _unwritable(out, e)
    names = [r.label for r in runs]
    for run, arg in zip(runs, args.run_dirs):
        if names.count(run.label) > 1:  # runs/a/x and runs/b/x: the paths tell them apart
            run.label = arg
        if run.tokens_per_step is None:
            print(f"jaxzero.plot: {arg}: tokens per step unknown (no config.json); loss by tokens left out")
    written = [out / "loss.png", out / "throughput.png"]
    offloaded = [r for r in runs if any(isinstance(x.get("step_s"), int | float) for x in r.records)]
    try:
        plot_loss(plt, runs, written[0])
        plot_throughput(plt, runs, written[1])
        if offloaded:
            written.append(out / "breakdown.png")
            plot_breakdown(plt, offloaded, written[-1])
    except OSError as e:  # --out not writable (a read-only mount, a full disk): one line
        return _unwritable(out, e)
    if offloaded:
        if len(offloaded) < len(runs):
            left = ", ".join(r.label for r in runs if r not in offloaded)
            print(f"jaxzero.plot: breakdown.png leaves out {left}: no breakdown (not offloaded)")
    else:
        stale = " (the breakdown.png there is an earlier one)" if (out / "breakdown.png").exists() else ""
        print(f"jaxzero.plot: no breakdown.png: no run has a step breakdown (offloaded runs do){stale}")
    plt.close("all")
    for p in written:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())

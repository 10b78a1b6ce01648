"""`python -m jaxzero.eval (--run_dir=DIR [--step=N] | --hf=DIR) --data.path=TOKENS [--split=val|train]
[--section.key=value ...]`: the loss, perplexity and target-token count of a model on a token set.

Every target of the split is counted once: the split's tokens are cut into consecutive windows of
`data.seq_len + 1` tokens that overlap by one (each window's last target is the next one's first input),
the last one padded with tokens no loss counts; a fine-tuning set (with its example index, `*.idx.bin`)
is read as training reads it, every example whole in rows, packed best fit or one per row (`data.pack`),
each example once; its loss masks (`*.mask.bin`) say which targets count. The split is the token set's
`val.bin` when it has one, else its `train.bin` whole (`--split` chooses). The loss is computed by the
trainer's own validation path (`Trainer.eval_loss`, the same function validation uses while training),
in the placement the planner decides for the model on this machine (`jaxzero.planner.preflight`); the other
`--section.key=value` settings apply on top of the run's saved config (or, with `--hf`, the defaults),
e.g. `--data.batch_size=32` (rows per evaluated batch) or `--data.cross_document_attention=true`. Only
the weights are read: a checkpoint's masters, one unit at a time, or a Hugging Face checkpoint. A
checkpoint's files are first checked against the checksums its save wrote, as a resume checks them
(`--checkpoint.verify=false` skips that).

The last line of standard output is one JSON object: `{"loss": ..., "perplexity": ..., "tokens": ...}`
with the split, the token files and the checkpoint it evaluated. Exit status 0; 2 with one line on
stderr for a bad argument, a missing checkpoint or token set, or a model that cannot fit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Iterator

import jax
import numpy as np

from jaxzero.config import ConfigError, ModelConfig, TrainConfig
from jaxzero.config.keys import config_from_dict
from jaxzero.data.packing import every_example_rows
from jaxzero.data.sources import open_split
from jaxzero.finetune.adapters import LORA_LAYOUT
from jaxzero.finetune.trainable import FROZEN_LAYOUT
from jaxzero.interop import load_hf_by_unit
from jaxzero.overrides import apply_overrides, layer, split_args
from jaxzero.planner import preflight
from jaxzero.run.console import ignore_closed_event_loops, to_stderr
from jaxzero.run.outcome import EXIT_CONFIG, EXIT_INTERRUPTED
from jaxzero.storage.checkpoint_layout import checkpoints_dir, read_meta, saved_step
from jaxzero.storage.checkpoint_masters import masters_by_unit, verify_checkpoint
from jaxzero.storage.state_io import restore_state
from jaxzero.trainer import build_trainer

# Settings an evaluation does not take from the run it evaluates: it saves nothing, logs no samples,
# reads the token files it is given, and lets the planner place the weights for this machine.
EVAL_SETTINGS = {
    "checkpoint.enabled": False,
    "logging.samples": 0,
    "logging.tensorboard": False,
    "data.source": "tokens",
    "offload.params": "auto",
    "offload.optimizer": "auto",
}


def main(argv: list[str] | None = None) -> int:
    to_stderr()  # the library's messages as `jaxzero: ...` lines
    ignore_closed_event_loops()  # Orbax's leftovers after a failed read: the error is one line
    ap = argparse.ArgumentParser(
        prog="python -m jaxzero.eval",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--run_dir", help="a training run directory with checkpoints/")
    src.add_argument("--hf", help="a Hugging Face checkpoint directory (config.json and safetensors)")
    ap.add_argument("--step", type=int, default=None, help="--run_dir: the checkpoint (default: the newest)")
    ap.add_argument("--split", choices=("val", "train"), default=None, help="default: val.bin if present")
    args, rest = ap.parse_known_args(argv)
    try:
        cfg, source = _config(args, rest)
        result = evaluate(cfg, source, args, args.split)
    except ConfigError as e:  # CheckpointError and DataError are ConfigErrors
        print(f"jaxzero: eval: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:  # eval writes nothing: stopping costs only the pass
        print("jaxzero: eval: interrupted (Ctrl-C); nothing was written.", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(
        f"jaxzero: eval: loss {result['loss']:.4f}, perplexity {result['perplexity']:.3f} over "
        f"{result['tokens']:,} targets of {result['split']} ({result['data']})"
    )
    print(json.dumps(result))
    return 0


def _config(args: argparse.Namespace, rest: list[str]) -> tuple[TrainConfig, str]:
    """The config to evaluate with (the run's saved one, or the defaults with the HF checkpoint's
    shape), the command line's settings on top, and a description of the weights' source."""
    if args.run_dir:
        step = saved_step(args.run_dir, args.step, "evaluate")
        base = config_from_dict(read_meta(checkpoints_dir(args.run_dir), step)["config"])
        base = dataclasses.replace(base, run_dir="")
        source = f"{args.run_dir} step {step}"
        args.step = step
    else:
        base, source = TrainConfig(), args.hf
        rest = [f"--model.name=hf:{args.hf}", *rest]
    layered = layer(base, split_args(rest))
    if args.run_dir:
        _check_same_model(base.model, layered.config.model, source)
    settings = {k: v for k, v in EVAL_SETTINGS.items() if k not in layered.sources}
    return apply_overrides(layered.config, settings), source


# What an evaluation of a run's checkpoint may set of model.*: how it computes, not what (llama's
# positions are computed: a longer max_seq_len reads the same weights; gpt2's are a table of that size).
EVAL_MODEL_SETTINGS = ("compute_dtype", "attention_impl", "moe_impl", "init_std", "init_from")


def _check_same_model(saved: ModelConfig, asked: ModelConfig, source: str) -> None:
    """ConfigError naming every model.* setting of `asked` that makes it another model than the
    checkpoint's (`saved`): its weights would not fit it, or would compute another function."""
    may = EVAL_MODEL_SETTINGS + (("max_seq_len",) if saved.family == "llama" else ())
    changed = [
        f"model.{f.name} ({getattr(saved, f.name)!r} -> {getattr(asked, f.name)!r})"
        for f in dataclasses.fields(ModelConfig)
        if f.name not in may and getattr(saved, f.name) != getattr(asked, f.name)
    ]
    if changed:
        raise ConfigError(
            f"{source} is evaluated as the model it trained: it cannot change {', '.join(changed)}. "
            f"Only model.{', model.'.join(m for m in may if not m.startswith('init_'))} may change; "
            "drop the others."
        )


def evaluate(cfg: TrainConfig, source: str, args: argparse.Namespace, split: str | None) -> dict:
    """Loss, perplexity and counted targets of the weights `args` names over the token files of
    `cfg.data`, one pass, every target once (see the module docstring)."""
    d = cfg.data
    tokens, counted, starts, split, path = open_split(d.path, d.token_dtype, cfg.model.vocab_size, split)
    if args.run_dir and cfg.checkpoint.verify:  # once, before any work: the reads below need not again
        verify_checkpoint(args.run_dir, args.step)
        cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, verify=False))
    decision = preflight.decide_before_jax(cfg)  # before JAX's backend starts: it sizes XLA's pools
    # The resolution pass's config: attention within the token set's documents, as training's (its
    # end-of-text id resolved).
    cfg = decision.config
    trainer = build_trainer(cfg, decision=decision)
    if args.run_dir and trainer.layout in (LORA_LAYOUT, FROZEN_LAYOUT):  # restored; the base rebuilt
        state = restore_state(trainer, args.run_dir, args.step)[0]
    elif args.run_dir:
        state = trainer.init_from_params(masters_by_unit(args.run_dir, args.step, verify=False)[1])
    else:
        state = trainer.init_from_params(load_hf_by_unit(cfg.model, args.hf))
    rows = max(d.batch_size, jax.device_count())
    rows -= rows % jax.device_count()  # put_eval_batch splits a batch's rows over the devices
    pad = 1 if cfg.data.eot_id == 0 else 0  # not the end-of-text id: the padding is one document
    total, targets = 0.0, 0
    if starts is not None:  # fine-tuning examples: each whole in its rows, as training reads them
        batches = _in_batches(every_example_rows(tokens, counted, starts, d.seq_len, d.pack, pad), rows)
    else:
        batches = eval_windows(tokens, counted, d.seq_len, rows, pad)
    for batch in batches:
        count = int(np.sum(batch[:, 1:] >= 0))
        if count:
            loss = float(trainer.eval_loss(state, trainer.put_eval_batch(batch)))  # host sync
            total, targets = total + loss * count, targets + count
    trainer.close()
    if not targets:
        raise ConfigError(f"{path} has no target the loss counts: nothing to evaluate.")
    loss = total / targets
    return {
        "loss": loss,
        "perplexity": math.exp(min(loss, 700.0)),
        "tokens": targets,
        "split": split,
        "data": str(path),
        "checkpoint": source,
    }


def eval_windows(
    tokens: np.ndarray, counted: np.ndarray | None, seq_len: int, rows: int, pad: int
) -> Iterator[np.ndarray]:
    """int32 (rows, seq_len + 1) batches of consecutive windows of `tokens` (1-D ids) overlapping by one
    token, so that every target (every token but the first) is in exactly one window; a target
    `counted` marks 0 (uint8 per token; None: all count) is written `~id`, as training's batches do.
    The last window is filled with `~pad`, and the last batch with rows of it: no loss counts them.
    Read batch by batch: the token files are never held whole."""
    starts = range(0, max(len(tokens) - 1, 1), seq_len)
    for first in range(0, len(starts), rows):
        batch = np.full((rows, seq_len + 1), ~pad, np.int32)
        for row, s in enumerate(starts[first : first + rows]):
            piece = np.asarray(tokens[s : s + seq_len + 1], np.int32)
            if counted is not None:
                piece = np.where(np.asarray(counted[s : s + seq_len + 1]) > 0, piece, ~piece)
            batch[row, : len(piece)] = piece
        yield batch


def _in_batches(blocks: Iterator[np.ndarray], rows: int) -> Iterator[np.ndarray]:
    """The rows of `blocks` (int32 (n, width) arrays) in batches of `rows`, the last filled with rows
    of padding (`~0`) no loss counts."""
    pending = np.zeros((0, 0), np.int32)
    for block in blocks:
        pending = block if not len(pending) else np.concatenate([pending, block])
        while len(pending) >= rows:
            yield pending[:rows]
            pending = pending[rows:]
    if len(pending):
        yield np.concatenate([pending, np.full((rows - len(pending), pending.shape[1]), ~0, np.int32)])


if __name__ == "__main__":
    sys.exit(main())

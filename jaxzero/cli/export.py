"""`python -m jaxzero.export --run_dir=DIR --out=DIR [--format=hf|orbax] [--dtype=bfloat16|float32]
[--step=N] [--overwrite] [--merge] [--checkpoint.verify=false]`: a consolidated inference checkpoint from
a training run's checkpoint.

A LoRA run (`finetune.method=lora`) exports its adapter in PEFT's format (`adapter_config.json` and
`adapter_model.safetensors`, for `peft.PeftModel.from_pretrained` over the base); with `--merge`, the
base with the adapters merged in, as `--format` says. The base merged into is the one the user gave:
`model.init_from`'s weights as its files hold them (float32 files stay float32, not the
`finetune.base_dtype` copy the run trained over), so the merged model computes what PEFT's adapter
over that base does; a base drawn from the seed (no `model.init_from`) is merged into as trained.
A `finetune.freeze` run's frozen units are written the same way: as the user's base holds them.

The checkpoint's files are checked against the checksums its save wrote, as a resume checks them,
before anything is written: a changed file is refused, naming it. `--checkpoint.verify=false` skips
the check.

`hf` writes Hugging Face safetensors plus `config.json` for `LlamaForCausalLM` / `GPT2LMHeadModel`
(sharded with an index file past `--max_shard_gb`); `orbax` writes the parameters as an Orbax
checkpoint with `model.json`, the model's description, beside them: `jaxzero.from_export(DIR)` loads
it, `--model.name=orbax:DIR` fine-tunes from it, and plain Orbax restores it. No optimizer state is
read or written. Only the master weights are restored (Orbax partial restore), as host NumPy arrays,
and they are converted one unit (embedding, block, head) at a time, so the model is never held twice
in RAM.

`--out` must be new, empty, or an earlier export (the `.jaxzero-export` marker each export writes
says which files are its own): `--overwrite` replaces a finished export, an unfinished one (a killed
export) is replaced anyway, and a directory holding anything else is refused with or without it
(`jaxzero.storage.export_dir`). Refusals exit 2 and write nothing.

To fine-tune from a Hugging Face checkpoint instead: `python -m jaxzero.train --model.name=hf:DIR`.
"""

from __future__ import annotations

import argparse
import os
import sys

from jaxzero.config import ConfigError
from jaxzero.config.keys import coerce
from jaxzero.finetune.merged import merged_into
from jaxzero.interop import export_hf
from jaxzero.interop.peft import export_peft_adapter
from jaxzero.run.console import ignore_closed_event_loops, to_stderr
from jaxzero.storage import export_dir
from jaxzero.storage.checkpoint_masters import export_orbax, masters_by_unit, saved_adapters


def main(argv: list[str] | None = None) -> int:
    to_stderr()  # the library's messages as `jaxzero: ...` lines
    ignore_closed_event_loops()  # Orbax's leftovers after a failed read: the error is one line
    ap = argparse.ArgumentParser(
        prog="python -m jaxzero.export",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--run_dir", required=True, help="a training run directory with checkpoints/")
    ap.add_argument("--out", required=True, help="a new or empty directory, or an earlier export")
    ap.add_argument("--format", choices=("hf", "orbax"), default="hf")
    ap.add_argument(
        "--dtype", choices=("bfloat16", "float32", "float16"), default=None, help="default bfloat16"
    )
    ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    ap.add_argument("--max_shard_gb", type=float, default=5.0, help="hf: shard files past this size")
    ap.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a finished earlier export in --out (the files its .jaxzero-export lists, only those)",
    )
    ap.add_argument(
        "--merge", action="store_true", help="a LoRA run: the merged model instead of the PEFT adapter"
    )
    ap.add_argument(
        "--checkpoint.verify",
        dest="verify",
        default="true",
        metavar="true|false",
        help="check the checkpoint's files against their checksums first (default true)",
    )
    args = ap.parse_args(argv)
    try:
        verify = coerce("checkpoint.verify", args.verify, bool)
        if not 2**-30 <= args.max_shard_gb < 2**33:  # NaN too: at least a byte, at most 8 EiB
            raise ConfigError(
                f"--max_shard_gb={args.max_shard_gb} is no file size: give the largest shard file in GB, "
                "e.g. --max_shard_gb=5 (the default)."
            )
        earlier = export_dir.check(args.out, args.overwrite)  # a refusal comes before the checkpoint is read
        if earlier.record is not None and not earlier.finished:
            print(
                f"jaxzero: {args.out} holds an unfinished export (killed midway): replacing it",
                file=sys.stderr,
            )
        lora = saved_adapters(args.run_dir, args.step, verify=verify)
        if lora is None and args.merge:
            raise ConfigError(
                f"--merge merges LoRA adapters; {args.run_dir} trained none: leave --merge out."
            )
        if lora is not None and not args.merge:
            if args.format != "hf" or args.dtype is not None:
                raise ConfigError(
                    f"{args.run_dir} is a LoRA run: its export is the adapter in PEFT's format (float32); "
                    "--format and --dtype apply to the merged model: add --merge."
                )
            cfg, adapters, step = lora
            source = {"run_dir": os.path.abspath(args.run_dir), "step": step}
            base = cfg.model.init_from  # a base drawn from the seed has no path PEFT could load
            out = export_peft_adapter(
                adapters, cfg.model, cfg.finetune, args.out, base, overwrite=args.overwrite, source=source
            )
            print(
                f"jaxzero: exported the LoRA adapter of step {step} of {args.run_dir} in PEFT's format: {out}"
            )
            return 0
        args.dtype = args.dtype or "bfloat16"
        # Read one unit at a time; a LoRA run's files were verified as its adapters were read above.
        step = lora[2] if lora is not None else args.step
        # A frozen part (LoRA's base, finetune.freeze's units) is written as the user gave it.
        cfg, params, step = masters_by_unit(
            args.run_dir, step, verify=verify and lora is None, base_as_given=True
        )
        source = {"run_dir": os.path.abspath(args.run_dir), "step": step}
        merged = ""
        if lora is not None:
            merged = f", the adapters merged into {merged_into(cfg)}"
        elif cfg.finetune.partial:
            merged = f", the frozen units from {merged_into(cfg)}"
        if args.format == "hf":
            files = export_hf(
                params,
                cfg.model,
                args.out,
                dtype=args.dtype,
                max_shard_bytes=int(args.max_shard_gb * 2**30),
                overwrite=args.overwrite,
                source=source,
            )
            print(
                f"jaxzero: exported step {step} of {args.run_dir} as Hugging Face {args.dtype}{merged}: "
                f"{', '.join(str(f) for f in files)}"
            )
        else:
            out = export_orbax(
                params, cfg.model, args.out, args.dtype, overwrite=args.overwrite, source=source
            )
            print(f"jaxzero: exported step {step} of {args.run_dir} as Orbax {args.dtype}{merged}: {out}")
    except (ConfigError, FileExistsError) as e:
        print(f"jaxzero: export error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the disk (full, not writable): one line; the export removed what it wrote
        print(f"jaxzero: export failed: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

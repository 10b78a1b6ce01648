"""`python -m jaxzero.generate --run_dir=DIR --prompt=TEXT [--prompt=TEXT ...]`: what a trained model
writes after a prompt. Also `--hf=DIR` (a Hugging Face checkpoint), `--step=N` (a checkpoint of the run;
default the newest), `--max_new_tokens`, `--temperature` (0: greedy, the default), `--top_p`, `--seed`.
A run's checkpoint is checked against the checksums its save wrote before its weights are read, as a
resume checks it (`--checkpoint.verify=false` skips that).

Decoding (`jaxzero.decode`) keeps each block's keys and values in a cache on the accelerator, and
streams the blocks from pinned host memory when they do not fit beside it.

Tokenizer: a run on the built-in corpus, or on token files `jaxzero.prepare` wrote with the byte-level
tokenizer, writes UTF-8 bytes and stops at NUL; on files prepared with a `tokenizer.json`, that one
and its end-of-text id (from `prepare.json`); `--tokenizer` names one otherwise.
"""

from __future__ import annotations

import argparse
import sys

from jaxzero.config import CheckpointError, ConfigError, TrainConfig
from jaxzero.config.keys import coerce
from jaxzero.data.tokenizer import codec_for
from jaxzero.data.types import DataError
from jaxzero.decode import Generator, Sampling
from jaxzero.interop import import_hf
from jaxzero.run.console import ignore_closed_event_loops, to_stderr
from jaxzero.storage.checkpoint_masters import load_masters


def main(argv: list[str] | None = None) -> int:
    to_stderr()  # the library's messages as `jaxzero: ...` lines
    ignore_closed_event_loops()  # Orbax's leftovers after a failed read: the error is one line
    ap = argparse.ArgumentParser(
        prog="python -m jaxzero.generate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--run_dir", help="a training run directory with checkpoints/")
    src.add_argument("--hf", help="a Hugging Face checkpoint directory (config.json, safetensors, tokenizer)")
    ap.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for more")
    ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    ap.add_argument("--tokenizer", default=None, help="a checkpoint directory or tokenizer.json")
    ap.add_argument("--max_new_tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--top_p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--checkpoint.verify",
        dest="verify",
        default="true",
        metavar="true|false",
        help="--run_dir: check the checkpoint's files against their checksums first (default true)",
    )
    args = ap.parse_args(argv)
    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_p, args.seed)
    try:
        sampling.check()
        verify = coerce("checkpoint.verify", args.verify, bool)
        if args.run_dir:
            cfg, params, step = load_masters(args.run_dir, args.step, verify=verify)
            codec = codec_for(cfg, args.tokenizer)
            model_cfg, source = cfg.model, f"{args.run_dir} step {step}"
        else:
            model_cfg, params = import_hf(args.hf)
            codec = codec_for(TrainConfig(), args.tokenizer or args.hf)
            source = args.hf
        prompts = [codec.encode(p) for p in args.prompt]
        longest = max(len(p) for p in prompts)
        if longest + args.max_new_tokens > model_cfg.max_seq_len:
            print(
                f"jaxzero: at most {model_cfg.max_seq_len - longest} new tokens after the longest prompt "
                f"({longest} tokens): model.max_seq_len={model_cfg.max_seq_len} bounds both together",
                file=sys.stderr,
            )
        gen = Generator(model_cfg, params, longest + args.max_new_tokens)
        print(f"jaxzero.generate: {source}{' (blocks streamed from host memory)' if gen.streamed else ''}")
        for prompt, prompt_ids in zip(args.prompt, prompts):
            ids = gen.generate(prompt_ids, sampling, codec.stop_id)
            print(f"--- {prompt!r}\n{prompt}{codec.decode(ids)}")
    except (ConfigError, CheckpointError, DataError) as e:
        print(f"jaxzero.generate: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The end-of-run samples on the built-in corpus (`logging.samples`): continuations of Python-source
prompts by the run's last checkpoint, through the decoder of `python -m jaxzero.generate`."""

from __future__ import annotations

import dataclasses
from typing import TextIO

import jax

from jaxzero.config import TrainConfig
from jaxzero.data.tokenizer import codec_for
from jaxzero.decode import Generator, Sampling
from jaxzero.models.sizes import param_count
from jaxzero.planner import runtime
from jaxzero.storage.checkpoint_masters import load_masters
from jaxzero.storage.run_dir import pasteable

# The samples read the model's float32 weights whole: at most this share of the free RAM.
SAMPLES_RAM_SHARE = 0.5
# Prompts of the samples on the built-in corpus (Python's standard library).
SAMPLE_PROMPTS = ("def ", "import ", "class ", "    return ", "# ")


def print_samples(cfg: TrainConfig, console: TextIO) -> None:
    """`logging.samples` continuations of Python-source prompts by the run's last checkpoint, sampled
    at temperature 0.8 and top_p 0.95, with the command that makes more."""
    if jax.process_count() > 1:  # the checkpoint is read whole by one process
        return
    whole = 4 * param_count(cfg.model)  # the float32 weights the sampler reads into host RAM
    if whole > SAMPLES_RAM_SHARE * runtime.host_memory_available():
        print(
            f"jaxzero: samples skipped: the model's float32 weights ({whole / 2**30:.1f} GiB) would not fit "
            "this host's free RAM beside the run; python -m jaxzero.generate "
            f"--run_dir={pasteable(cfg.run_dir)} --prompt=TEXT samples on a machine that holds them.",
            file=console,
        )
        return
    cfg_saved, params, step = load_masters(cfg.run_dir, verify=cfg.checkpoint.verify)
    codec = codec_for(cfg_saved)
    prompts = [SAMPLE_PROMPTS[i % len(SAMPLE_PROMPTS)] for i in range(cfg.logging.samples)]
    sampling = Sampling(max_new_tokens=120, temperature=0.8, top_p=0.95, seed=cfg.seed)
    gen = Generator(cfg_saved.model, params, max(map(len, prompts)) + sampling.max_new_tokens)
    print(
        f"jaxzero: samples of step {step} (temperature 0.8, top_p 0.95; more: python -m jaxzero.generate "
        f"--run_dir={pasteable(cfg.run_dir)} --prompt=TEXT):",
        file=console,
    )
    for k, prompt in enumerate(prompts):
        ids = gen.generate(
            codec.encode(prompt), dataclasses.replace(sampling, seed=cfg.seed + k), codec.stop_id
        )
        print(f"--- {prompt!r}\n{prompt}{codec.decode(ids)}", file=console)

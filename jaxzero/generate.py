"""`python -m jaxzero.generate --run_dir=DIR --prompt=TEXT [--prompt=TEXT ...]`: what a trained model
writes after a prompt. Also `--hf=DIR` (a Hugging Face checkpoint), `--step=N` (a checkpoint of the run;
default the newest), `--max_new_tokens`, `--temperature` (0: greedy, the default), `--top_p`, `--seed`.

Decoding keeps each block's keys and values in a cache on the accelerator: the prompt runs once
through every block (prefill), then each new token runs through alone against the cache, compiled once
for each of the two shapes. Weights go to the accelerator in the compute dtype when they and the cache
fit in its free memory; otherwise the blocks stay in pinned host memory and each is copied in when
a token's pass reaches it (every token then moves the blocks across the link once).

Tokenizer: a run on the built-in corpus, or on token files `jaxzero.prepare` wrote with the byte-level
tokenizer, writes UTF-8 bytes and stops at NUL; on files prepared with a `tokenizer.json`, that one
and its end-of-text id (from `prepare.json`); `--tokenizer` names one otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxzero.config import CheckpointError, ConfigError, ModelConfig, TrainConfig
from jaxzero.data import BUILTIN_SEPARATOR, DataError
from jaxzero.export import load_masters
from jaxzero.interop import import_hf
from jaxzero.models import KVCache, ModelParams, build_model
from jaxzero.models.layers import cast_tree, compute_dtype
from jaxzero.prepare import META_NAME, ByteTokenizer, HFTokenizer, default_eot_id, tokenizer_file

# Free accelerator memory kept unused when deciding whether the weights fit.
_HEADROOM = 0.9


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: greedy at temperature 0, else from softmax(logits / temperature)
    restricted to the smallest set of tokens whose probability reaches `top_p`."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def check(self) -> None:
        if self.max_new_tokens < 1 or self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ConfigError(
                f"max_new_tokens={self.max_new_tokens} must be >= 1, temperature={self.temperature} >= 0 "
                f"and top_p={self.top_p} in (0, 1]."
            )


def sample_next(logits: jax.Array, key: jax.Array, temperature: float, top_p: float) -> jax.Array:
    """int32 (B,) next tokens from float32 logits (B, V): argmax at temperature 0, else nucleus sampling
    (the most probable tokens up to `top_p` of the probability, at least one)."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_p < 1:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # probability of the tokens ranked above
        sorted_logits = jnp.where(before < top_p, sorted_logits, -jnp.inf)
        logits = (
            jnp.full_like(logits, -jnp.inf).at[jnp.arange(logits.shape[0])[:, None], order].set(sorted_logits)
        )
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


class Generator:
    """Greedy or sampled continuation of token ids with `model_cfg`'s model and float32 `params` (host).

    The weights are cast to the compute dtype and placed once (see the module docstring); `max_len`
    bounds prompt plus new tokens (at most `model_cfg.max_seq_len`).
    """

    def __init__(self, model_cfg: ModelConfig, params: ModelParams, max_len: int, device: Any = None) -> None:
        self.model = build_model(model_cfg)
        self.max_len = min(max_len, model_cfg.max_seq_len)
        self.device = device or jax.devices()[0]
        dtype = compute_dtype(model_cfg)
        weights = cast_tree(params, dtype)
        cache_bytes = 2 * model_cfg.num_layers * self.max_len * model_cfg.num_kv_heads * model_cfg.head_dim
        cache_bytes *= jnp.dtype(dtype).itemsize
        weight_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(weights))
        self.streamed = not _fits(self.device, weight_bytes + cache_bytes)
        on_device = jax.sharding.SingleDeviceSharding(self.device, memory_kind="device")
        self.embed = jax.device_put(weights.embed, on_device)
        self.head = jax.device_put(weights.head, on_device)
        where = on_device.with_memory_kind("pinned_host") if self.streamed else on_device
        self.blocks = [jax.device_put(b, where) for b in weights.blocks]
        self._on_device = on_device
        m = self.model
        self._embed = jax.jit(m.embed_step)
        self._block = jax.jit(m.block_step, donate_argnums=(2,))  # the cache is updated in place
        self._head = jax.jit(lambda h, e, x: m.head(h, e, x[:, -1:])[:, 0])  # the last position's logits
        self._sample = jax.jit(sample_next, static_argnames=("temperature", "top_p"))

    def _forward(self, tokens: jax.Array, pos: int, caches: list[KVCache]) -> jax.Array:
        x = self._embed(self.embed, tokens, jnp.int32(pos))
        for i, block in enumerate(self.blocks):
            if self.streamed:
                block = jax.device_put(block, self._on_device)
            x, caches[i] = self._block(block, x, caches[i], jnp.int32(pos))
        return self._head(self.head, self.embed, x)

    def generate(self, prompt: Sequence[int], sampling: Sampling, stop_id: int | None = None) -> list[int]:
        """The new token ids after `prompt` (at most `sampling.max_new_tokens`, fewer at `stop_id`,
        which is not returned, or at the model's length)."""
        sampling.check()
        if not prompt:
            raise ConfigError("the prompt is empty: the model needs at least one token to continue.")
        if len(prompt) >= self.max_len:
            raise ConfigError(
                f"the prompt has {len(prompt)} tokens; the model continues at most {self.max_len} in all "
                f"(model.max_seq_len={self.model.config.max_seq_len}). Shorten it."
            )
        with jax.default_device(self.device):
            caches = [self.model.init_cache(1, self.max_len) for _ in self.blocks]
            key = jax.random.key(sampling.seed)
            logits = self._forward(jnp.asarray([list(prompt)], jnp.int32), 0, caches)
            out: list[int] = []
            pos = len(prompt)
            while len(out) < sampling.max_new_tokens and pos < self.max_len:
                key, sub = jax.random.split(key)
                token = int(self._sample(logits, sub, sampling.temperature, sampling.top_p)[0])  # host sync
                if token == stop_id:
                    break
                out.append(token)
                if pos + 1 >= self.max_len:
                    break
                logits = self._forward(jnp.asarray([[token]], jnp.int32), pos, caches)
                pos += 1
        return out


def _fits(device: Any, needed: int) -> bool:
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:  # the CPU backend: host memory, no limit to read
        return True
    return needed <= _HEADROOM * (stats["bytes_limit"] - stats.get("bytes_in_use", 0))


class TextCodec:
    """Text to ids and back with a run's tokenizer, and the id that ends a document."""

    def __init__(self, tokenizer: ByteTokenizer | HFTokenizer, stop_id: int | None) -> None:
        self.tokenizer, self.stop_id = tokenizer, stop_id

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer.encode([text])[0]]

    def decode(self, ids: Sequence[int]) -> str:
        if isinstance(self.tokenizer, ByteTokenizer):
            return bytes(ids).decode("utf-8", errors="replace")
        return self.tokenizer.tok.decode(list(ids))


def codec_for(cfg: TrainConfig, tokenizer: str | None = None) -> TextCodec:
    """The tokenizer a run's data was made with (module docstring), or `tokenizer` (a checkpoint
    directory or tokenizer.json) when given. ConfigError when neither says which."""
    if tokenizer:
        file = tokenizer_file(tokenizer)
        tok = HFTokenizer(file)
        try:
            stop: int | None = default_eot_id(file, tok)
        except DataError:
            stop = None
        return TextCodec(tok, stop)
    d = cfg.data
    if d.source == "builtin":
        return TextCodec(ByteTokenizer(), BUILTIN_SEPARATOR[0])
    meta_path = Path(d.path) / META_NAME
    if d.source == "tokens" and meta_path.is_file():
        recipe = json.loads(meta_path.read_text())["recipe"]
        if recipe["tokenizer"] == "bytes":
            return TextCodec(ByteTokenizer(), recipe["eot_id"])
        return TextCodec(HFTokenizer(tokenizer_file(recipe["tokenizer"])), recipe["eot_id"])
    raise ConfigError(
        f"no tokenizer is known for data.source={d.source} (data.path={d.path!r} has no {META_NAME}); "
        "pass --tokenizer=DIR (a checkpoint directory with tokenizer.json) or the tokenizer.json."
    )


def main(argv: list[str] | None = None) -> int:
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
    args = ap.parse_args(argv)
    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_p, args.seed)
    try:
        sampling.check()
        if args.run_dir:
            cfg, params, step = load_masters(args.run_dir, args.step)
            codec = codec_for(cfg, args.tokenizer)
            model_cfg, source = cfg.model, f"{args.run_dir} step {step}"
        else:
            model_cfg, params = import_hf(args.hf)
            codec = codec_for(TrainConfig(), args.tokenizer or args.hf)
            source = args.hf
        prompts = [codec.encode(p) for p in args.prompt]
        gen = Generator(model_cfg, params, max(len(p) for p in prompts) + args.max_new_tokens)
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

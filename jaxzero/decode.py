"""Continuing token ids with a trained model: a key/value cache per block on the accelerator, the
prompt run once through every block (prefill), then each new token alone against the cache, compiled
once for each of the two shapes. Greedy or temperature / top-p sampling.

Weights go to the accelerator in the compute dtype when they and the cache fit in its free memory;
otherwise the blocks stay in pinned host memory and each is copied in when a token's pass reaches it
(every token then moves the blocks across the link once).

Documents: generation continues one prompt, read as one document: every token attends to the whole
prompt and what follows it (no segment ids; `jaxzero.numerics.objective.document_segments` is training's and
evaluation's). A prompt holding end-of-text ids is not split at them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxzero.config import ConfigError, ModelConfig
from jaxzero.models import KVCache, ModelParams, build_model, layer_input
from jaxzero.models.layers import cast_tree, compute_dtype

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
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={self.max_new_tokens} must be >= 1.")
        if not 0 <= self.temperature < math.inf:
            raise ConfigError(f"temperature={self.temperature} must be >= 0 and finite (0: greedy).")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p={self.top_p} must be in (0, 1] (1: the whole distribution).")


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
        self._layers = [layer_input(m, i) for i in range(len(self.blocks))]  # None without one
        self._head = jax.jit(lambda h, e, x: m.head(h, e, x[:, -1:])[:, 0])  # the last position's logits
        self._sample = jax.jit(sample_next, static_argnames=("temperature", "top_p"))

    def _forward(self, tokens: jax.Array, pos: int, caches: list[KVCache]) -> jax.Array:
        x = self._embed(self.embed, tokens, jnp.int32(pos))
        for i, block in enumerate(self.blocks):
            if self.streamed:
                block = jax.device_put(block, self._on_device)
            layer = () if self._layers[i] is None else (self._layers[i],)
            x, caches[i] = self._block(block, x, caches[i], jnp.int32(pos), *layer)
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

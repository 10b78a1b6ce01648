"""Transformer models exposed as embed -> N identical blocks -> head.

Every model is split into three units so that one compiled block function serves every layer and an
offload engine can place and move layers one at a time. Blocks are Flax (linen) modules
(`LlamaBlock`, `GPT2Block`) applied to one layer's parameter pytree; embed and head are small pure
functions. Models know nothing of memory kinds or devices: they are pure functions of parameter
pytrees.

    params = model.init(key)                    # ModelParams, float32 masters
    x = model.embed(params.embed, tokens)       # (B, S) int32 -> (B, S, D) compute dtype
    for p in params.blocks: x = model.block(p, x)
    logits = model.head(params.head, params.embed, x)   # (B, S, V) float32
"""

from __future__ import annotations

from jaxzero.config import ModelConfig
from jaxzero.models.base import (
    KVCache,
    Model,
    ModelParams,
    add_layer_stats,
    emits_stats,
    forward,
    init_keys,
    init_params,
    layer_input,
    run_block,
    run_block_stats,
)
from jaxzero.models.gemma import Gemma3
from jaxzero.models.gpt2 import GPT2
from jaxzero.models.gpt_oss import GptOss
from jaxzero.models.llama import Llama

__all__ = [
    "GPT2",
    "Gemma3",
    "GptOss",
    "KVCache",
    "Llama",
    "Model",
    "ModelParams",
    "add_layer_stats",
    "build_model",
    "emits_stats",
    "forward",
    "init_keys",
    "init_params",
    "layer_input",
    "run_block",
    "run_block_stats",
]


def build_model(config: ModelConfig) -> Model:
    """The model of `config.family`."""
    if config.family == "llama":
        return Llama(config)
    if config.family == "gpt2":
        return GPT2(config)
    if config.family == "gemma3":
        return Gemma3(config)
    if config.family == "gpt_oss":
        return GptOss(config)
    raise ValueError(
        f"unknown model family {config.family!r}; choose 'llama', 'gpt2', 'gemma3' or 'gpt_oss'."
    )

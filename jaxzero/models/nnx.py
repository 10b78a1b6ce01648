"""A researcher's own Flax NNX modules as a jaxzero model (`from_nnx`): the block protocol
(`jaxzero.models.base.Model`) over `nnx.split` / `nnx.merge`, so that the engines that train jaxzero's
own families, resident or streamed, train it unchanged.

Each unit (embedding, block, head) is an NNX module built by a factory `factory(rngs=nnx.Rngs(key))`.
Its graph definition (the module's structure and static attributes) is taken once, abstractly, and
held static; its `nnx.Param` values are the unit's parameters, a nested dict of arrays
(`nnx.to_pure_dict`, keys as strings): a plain pytree that jit, memory-kind placement, Orbax and the
host optimizer take as they take any family's. Every call merges the graph definition with the arrays
it is given, so a unit's function is pure.

Only `nnx.Param` state is trained: modules holding other state (an `nnx.Dropout` given `rngs`, an
`nnx.BatchNorm`'s statistics, caches) are refused when the model is made, since the engines thread no
state but parameters through a step.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxzero.config import ConfigError, ModelConfig
from jaxzero.models.base import ModelParams, init_params

# factory(rngs=nnx.Rngs(key)) -> the unit's module, its parameters float32.
Factory = Callable[..., nnx.Module]


class NNXModel:
    """The block protocol over NNX modules (`from_nnx` makes one); training only: it has no decoding
    methods (`init_cache / embed_step / block_step`), so generation needs a model of its own.

    The modules are called as:
      embed:  `module(tokens)`, int32 (B, S) -> (B, S, D);
      block:  `module(x)` (B, S, D) -> (B, S, D), causal; `module(x, segments=segments)` (int32
              (B, S)) where training keeps documents apart (`data.cross_document_attention=false`);
      head:   `module(x)` -> logits (B, S, V), or with `model.tie_embeddings` `module(x, embed)`, the
              embedding's module given (e.g. `embed.attend(h)`); the logits are returned as float32.
    """

    def __init__(self, config: ModelConfig, *, embed: Factory, block: Factory, head: Factory):
        self.config = config
        self._factories = {"embed": embed, "block": block, "head": head}
        # Each module traced abstractly, once: nothing is allocated.
        modules = {
            name: nnx.eval_shape(lambda f=f: f(rngs=nnx.Rngs(0))) for name, f in self._factories.items()
        }
        self._defs = {name: _definition(name, m) for name, m in modules.items()}
        self._shapes = {name: _param_shapes(nnx.state(m, nnx.Param)) for name, m in modules.items()}
        if not _takes_segments(modules["block"]):
            # The protocol's first form, which document-aware training refuses when the trainer is
            # built (`jaxzero.numerics.objective.document_eot` reads the signature).
            self.block = self._block_across_documents

    def init(self, key: jax.Array) -> ModelParams:
        """Fresh float32 `ModelParams`, each unit from its own key (`jaxzero.models.init_keys`)."""
        return init_params(self, key)

    def init_embed(self, key: jax.Array) -> dict[str, Any]:
        """The embedding module's parameters, built from `key`."""
        return self._init("embed", key)

    def init_block(self, key: jax.Array) -> dict[str, Any]:
        """One block module's parameters, built from `key`: refused where the factory built a module
        unlike the one it built first (one compiled block function serves every layer)."""
        return self._init("block", key)

    def init_head(self, key: jax.Array) -> dict[str, Any]:
        """The head module's parameters, built from `key`."""
        return self._init("head", key)

    def embed(self, embed_params: dict[str, Any], tokens: jax.Array) -> jax.Array:
        """int32 tokens (B, S) -> activations (B, S, D)."""
        return self._module("embed", embed_params)(tokens)

    def block(
        self, block_params: dict[str, Any], x: jax.Array, segments: jax.Array | None = None
    ) -> jax.Array:
        """One block, (B, S, D) -> (B, S, D); within `segments` (int32 (B, S)) where given."""
        module = self._module("block", block_params)
        return module(x) if segments is None else module(x, segments=segments)

    def _block_across_documents(self, block_params: dict[str, Any], x: jax.Array) -> jax.Array:
        return self._module("block", block_params)(x)

    def head(self, head_params: dict[str, Any], embed_params: dict[str, Any], x: jax.Array) -> jax.Array:
        """(B, S, D) -> float32 logits (B, S, V); a tied head is given the embedding's module."""
        module = self._module("head", head_params)
        if self.config.tie_embeddings:
            return module(x, self._module("embed", embed_params)).astype(jnp.float32)
        return module(x).astype(jnp.float32)

    def _init(self, name: str, key: jax.Array) -> dict[str, Any]:
        graphdef, params, _ = nnx.split(self._factories[name](rngs=nnx.Rngs(key)), nnx.Param, ...)
        if graphdef != self._defs[name]:
            first, now = self._shapes[name], _param_shapes(params)
            differ = [
                f"{p}: {first.get(p)} then {now.get(p)}"
                for p in sorted({*first, *now})
                if first.get(p) != now.get(p)
            ]
            raise ConfigError(
                f"the {name} factory built a module unlike the one it built first "
                f"({'; '.join(differ[:4]) or 'the same parameters, other module types or settings'}): "
                f"every {name} must be the same module (one compiled function serves every layer): "
                "build each alike, and pass what differs between layers as data."
            )
        return _string_keys(nnx.to_pure_dict(params))

    def _module(self, name: str, params: dict[str, Any]) -> nnx.Module:
        return nnx.merge(self._defs[name], params)


def from_nnx(config: ModelConfig, *, embed: Factory, block: Factory, head: Factory) -> NNXModel:
    """A jaxzero model (`build_trainer(cfg, model=from_nnx(cfg.model, ...))`) of NNX modules: each
    factory is called as `factory(rngs=nnx.Rngs(key))` (e.g. `functools.partial(MyBlock, cfg)`) and
    builds its unit with float32 `nnx.Param`s; `config` describes the model's shape for the memory
    planner (`jaxzero.custom` checks the counts). The factories are traced abstractly here: nothing is
    allocated. Raises ConfigError for a module holding state other than `nnx.Param`s."""
    return NNXModel(config, embed=embed, block=block, head=head)


def _definition(name: str, module: nnx.Module) -> Any:
    """The graph definition of `module` (abstract); refused where it holds state other than
    parameters, which no engine threads through a step."""
    graphdef, _, rest = nnx.split(module, nnx.Param, ...)
    held = [f"{'.'.join(map(str, path))} ({type(v).__name__})" for path, v in nnx.to_flat_state(rest)]
    if held:
        raise ConfigError(
            f"the {name} module holds state other than nnx.Param: {', '.join(held)}. jaxzero trains "
            "parameters only: build dropout without rngs (or leave it out), use a norm without "
            "running statistics (nnx.LayerNorm, nnx.RMSNorm), and keep no caches in the module."
        )
    return graphdef


def _takes_segments(module: nnx.Module) -> bool:
    """Whether `module` is called with a `segments` keyword."""
    params = inspect.signature(module.__call__).parameters.values()
    return any(p.name == "segments" or p.kind is p.VAR_KEYWORD for p in params)


def _param_shapes(params: nnx.State) -> dict[str, tuple[tuple[int, ...], str]]:
    """Each parameter's (shape, dtype) by its dotted path."""
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(params))[0]
    return {".".join(str(k.key) for k in path): (tuple(x.shape), str(x.dtype)) for path, x in flat}


def _string_keys(tree: Any) -> Any:
    """A pure dict with every key a string (an `nnx.List`'s indices are ints), as a checkpoint's
    paths name them; `nnx.merge` reads the indices back from the strings."""
    if isinstance(tree, dict):
        return {str(k): _string_keys(v) for k, v in tree.items()}
    return tree

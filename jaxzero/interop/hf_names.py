"""The Hugging Face tensor map: each jaxzero parameter's HF name, shape and layout.

Name and layout map (see the docstrings of `jaxzero.models.llama` and `jaxzero.models.gpt2`): jaxzero's
parameter dicts already use HF's module names, so a tensor's HF name is its unit prefix plus its dict
path, with "kernel"/"scale"/"embedding" renamed to "weight". Llama kernels are stored (in, out) in
jaxzero and (out, in) by torch's `nn.Linear`, so they are transposed; GPT-2's `Conv1D` already stores
(in, out), so GPT-2 is a pure rename.

Also here: the base-model prefixes a checkpoint may leave out, the buffers it may hold besides the
parameters, and helpers that walk the nested dicts of one unit of `ModelParams`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxzero.config import ModelConfig
from jaxzero.interop.hf_variants import llama_model_type
from jaxzero.models import ModelParams, build_model

# The prefix of the base model's modules inside `*ForCausalLM` (transformers' `base_model_prefix`).
# Checkpoints saved from the headless base class (`LlamaModel`, `GPT2Model`; e.g. the original
# openai-community/gpt2 files) lack it, and transformers accepts both, so import does too.
BASE_PREFIX = {"llama": "model.", "gpt2": "transformer.", "gemma3": "model.", "gpt_oss": "model."}
# Where else a family's base model may sit: Gemma 3 4B-27B are released as
# Gemma3ForConditionalGeneration, whose text model's tensors are "language_model.model.*" on the
# Hub ("model.language_model.*" inside transformers 5); import reads the text model from either.
BASE_ALIASES = {"gemma3": ("language_model.model.", "model.language_model.")}

# Tensors some writers saved that are buffers or duplicates, not parameters: RoPE inverse frequencies
# (old Llama checkpoints), GPT-2's causal-mask buffers `attn.bias`/`attn.masked_bias` (not the
# parameter `attn.c_attn.bias`), and the output head of a tied model (transformers re-ties it to the
# input embedding on load, so that copy is never used; we do the same).
IGNORED = {
    "llama": re.compile(r"^(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq$"),
    "gpt2": re.compile(r"^(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)$|^lm_head\.weight$"),
    "gemma3": re.compile(
        r"^(language_model\.)?lm_head\.weight$|^(model\.)?(vision_tower|multi_modal_projector)\."
    ),
    "gpt_oss": re.compile(r"(?!)"),  # none (a tied head's copy: as for llama, in hf_io)
}


@dataclass(frozen=True)
class HFTensor:
    """One parameter: its HF name (with the base prefix), where it lives in its jaxzero unit, its
    jaxzero shape, and whether HF stores it transposed (torch Linear's (out, in); of a stack of
    matrices, each one's: the last two axes swapped)."""

    hf_name: str
    path: tuple[str, ...]
    shape: tuple[int, ...]
    transpose: bool = False
    # One expert's matrix inside a (E, in, out) leaf of shape `leaf_shape`: leaf[e, :, lo:hi], as
    # (e, lo, hi). None: the tensor is the whole leaf.
    part: tuple[int, int, int] | None = None
    leaf_shape: tuple[int, ...] = ()
    # The halves [a | b] of the last axis are stored interleaved (a at ::2, b at 1::2): gpt-oss's
    # gate_up kernels and biases.
    interleaved: bool = False
    # The checkpoint may store it in MXFP4 as "<name>_blocks" and "<name>_scales" (gpt-oss's experts).
    mxfp4: bool = False

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return (*self.shape[:-2], self.shape[-1], self.shape[-2]) if self.transpose else self.shape

    @property
    def full_shape(self) -> tuple[int, ...]:
        """The shape of the jaxzero leaf the tensor is (or is part of)."""
        return self.leaf_shape if self.part else self.shape

    def take(self, leaf: Any) -> Any:
        """This tensor's values of its jaxzero leaf (a view), in jaxzero's orientation."""
        if self.part is None:
            return leaf
        e, lo, hi = self.part
        return leaf[e, :, lo:hi]

    def from_hf(self, stored: Any) -> np.ndarray:
        """A fresh float32 C-contiguous array in jaxzero's layout of the tensor `stored` as HF holds it."""
        array = np.swapaxes(stored, -1, -2) if self.transpose else stored
        if self.interleaved:
            array = np.concatenate([array[..., 0::2], array[..., 1::2]], axis=-1)
        return np.array(array, dtype=np.float32, order="C")

    def to_hf(self, leaf: Any, dtype: Any) -> np.ndarray:
        """`leaf` (this tensor's values in jaxzero's layout) as HF stores it, in `dtype`, C-contiguous."""
        if self.interleaved:
            half = leaf.shape[-1] // 2
            out = np.empty(leaf.shape, dtype)
            out[..., 0::2], out[..., 1::2] = leaf[..., :half], leaf[..., half:]
            return out
        return np.array(np.swapaxes(leaf, -1, -2) if self.transpose else leaf, dtype=dtype, order="C")


@dataclass(frozen=True)
class HFUnit:
    """One unit of `ModelParams` ("embed", "block i", "head") and its tensors, in HF save order."""

    label: str
    tensors: tuple[HFTensor, ...]


def _llama_units(cfg: ModelConfig) -> list[HFUnit]:
    d, v, hd = cfg.hidden_size, cfg.vocab_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    units = [HFUnit("embed", (HFTensor("model.embed_tokens.weight", ("embed_tokens", "embedding"), (v, d)),))]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        attn = []
        projections = (("q_proj", q), ("k_proj", kv), ("v_proj", kv))
        if cfg.fused_projections:  # Phi-3: [q | k | v] as one tensor, as in jaxzero
            projections = (("qkv_proj", q + 2 * kv),)
        for proj, width in projections:
            attn.append(
                HFTensor(f"{p}self_attn.{proj}.weight", ("self_attn", proj, "kernel"), (d, width), True)
            )
            if cfg.attention_bias:
                attn.append(HFTensor(f"{p}self_attn.{proj}.bias", ("self_attn", proj, "bias"), (width,)))
        if cfg.qk_norm:  # over each head (Qwen3) or over the whole projection (OLMo 2)
            widths = (q, kv) if cfg.qk_norm_scope == "projection" else (hd, hd)
            for norm, width in zip(("q_norm", "k_norm"), widths):
                attn.append(HFTensor(f"{p}self_attn.{norm}.weight", ("self_attn", norm, "scale"), (width,)))

        def norm(name: str) -> HFTensor:
            return HFTensor(p + name + ".weight", (name, "scale"), (d,))  # noqa: B023

        o_proj = HFTensor(p + "self_attn.o_proj.weight", ("self_attn", "o_proj", "kernel"), (q, d), True)
        if cfg.post_norm:  # OLMo 2: no norm before the attention, one after the MLP
            tensors = (*attn, o_proj, norm("post_attention_layernorm"), *_llama_mlp(cfg, p))
            tensors += (norm("post_feedforward_layernorm"),)
        else:
            tensors = (norm("input_layernorm"), *attn, o_proj, norm("post_attention_layernorm"))
            tensors += tuple(_llama_mlp(cfg, p))
        units.append(HFUnit(f"block {i}", tensors))
    units.append(_head_unit(cfg))
    return units


def _head_unit(cfg: ModelConfig) -> HFUnit:
    """The final norm and, unless the embeddings are tied, `lm_head` (Llama's names, gpt-oss's too)."""
    d = cfg.hidden_size
    head = [HFTensor("model.norm.weight", ("norm", "scale"), (d,))]
    if not cfg.tie_embeddings:
        head.append(HFTensor("lm_head.weight", ("lm_head", "kernel"), (d, cfg.vocab_size), True))
    return HFUnit("head", tuple(head))


def _llama_mlp(cfg: ModelConfig, p: str) -> list[HFTensor]:
    """Block `p`'s MLP tensors: dense, or the router and every expert's three matrices as the
    released checkpoints store them (Qwen3-MoE `mlp.experts.e.gate_proj`, Mixtral
    `block_sparse_moe.experts.e.w1`; transformers 5 saves them so and fuses them on load; Granite's
    experts are fused: `block_sparse_moe.input_linear` (E, 2F, D), `output_linear` (E, D, F))."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    if cfg.fused_projections:  # Phi-3: [gate | up] as one tensor, as in jaxzero
        return [
            HFTensor(p + "mlp.gate_up_proj.weight", ("mlp", "gate_up_proj", "kernel"), (d, 2 * f), True),
            HFTensor(p + "mlp.down_proj.weight", ("mlp", "down_proj", "kernel"), (f, d), True),
        ]
    if not cfg.num_experts:
        return [
            HFTensor(p + "mlp.gate_proj.weight", ("mlp", "gate_proj", "kernel"), (d, f), True),
            HFTensor(p + "mlp.up_proj.weight", ("mlp", "up_proj", "kernel"), (d, f), True),
            HFTensor(p + "mlp.down_proj.weight", ("mlp", "down_proj", "kernel"), (f, d), True),
        ]
    e, f = cfg.num_experts, cfg.moe_intermediate_size
    model_type = llama_model_type(cfg)  # what config.json says, which transformers names by
    if model_type == "granitemoe":  # every expert in one (E, out, in) tensor, [gate; up] rows
        m = p + "block_sparse_moe."
        return [
            HFTensor(m + "router.layer.weight", ("mlp", "router", "kernel"), (d, e), True),
            HFTensor(m + "input_linear.weight", ("mlp", "gate_up", "kernel"), (e, d, 2 * f), True),
            HFTensor(m + "output_linear.weight", ("mlp", "down", "kernel"), (e, f, d), True),
        ]
    mixtral = model_type == "mixtral"
    m = p + ("block_sparse_moe." if mixtral else "mlp.")
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    out = [HFTensor(m + "gate.weight", ("mlp", "router", "kernel"), (d, e), True)]
    gate_up, down = ("mlp", "gate_up", "kernel"), ("mlp", "down", "kernel")
    for i in range(e):
        x = f"{m}experts.{i}."
        out += [
            HFTensor(x + names[0] + ".weight", gate_up, (d, f), True, (i, 0, f), (e, d, 2 * f)),
            HFTensor(x + names[1] + ".weight", gate_up, (d, f), True, (i, f, 2 * f), (e, d, 2 * f)),
            HFTensor(x + names[2] + ".weight", down, (f, d), True, (i, 0, d), (e, f, d)),
        ]
    return out


def _gemma3_units(cfg: ModelConfig) -> list[HFUnit]:
    d, f, v, hd = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    units = [HFUnit("embed", (HFTensor("model.embed_tokens.weight", ("embed_tokens", "embedding"), (v, d)),))]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."

        def norm(name: str, width: int = d) -> HFTensor:
            return HFTensor(p + name + ".weight", tuple(name.split(".")) + ("scale",), (width,))  # noqa: B023

        def linear(name: str, shape: tuple[int, int]) -> HFTensor:
            return HFTensor(p + name + ".weight", (*name.split("."), "kernel"), shape, True)  # noqa: B023

        tensors = (
            norm("input_layernorm"),
            linear("self_attn.q_proj", (d, q)),
            linear("self_attn.k_proj", (d, kv)),
            linear("self_attn.v_proj", (d, kv)),
            linear("self_attn.o_proj", (q, d)),
            norm("self_attn.q_norm", hd),
            norm("self_attn.k_norm", hd),
            norm("post_attention_layernorm"),
            norm("pre_feedforward_layernorm"),
            linear("mlp.gate_proj", (d, f)),
            linear("mlp.up_proj", (d, f)),
            linear("mlp.down_proj", (f, d)),
            norm("post_feedforward_layernorm"),
        )
        units.append(HFUnit(f"block {i}", tensors))
    units.append(HFUnit("head", (HFTensor("model.norm.weight", ("norm", "scale"), (d,)),)))
    return units


def _gpt_oss_units(cfg: ModelConfig) -> list[HFUnit]:
    d, v, hd, e, f = cfg.hidden_size, cfg.vocab_size, cfg.head_dim, cfg.num_experts, cfg.moe_intermediate_size
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    units = [HFUnit("embed", (HFTensor("model.embed_tokens.weight", ("embed_tokens", "embedding"), (v, d)),))]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        attn = []
        for proj, (n_in, n_out) in (
            ("q_proj", (d, q)),
            ("k_proj", (d, kv)),
            ("v_proj", (d, kv)),
            ("o_proj", (q, d)),
        ):
            attn.append(
                HFTensor(f"{p}self_attn.{proj}.weight", ("self_attn", proj, "kernel"), (n_in, n_out), True)
            )
            if cfg.attention_bias:
                attn.append(HFTensor(f"{p}self_attn.{proj}.bias", ("self_attn", proj, "bias"), (n_out,)))
        x = p + "mlp.experts."
        tensors = (
            HFTensor(p + "input_layernorm.weight", ("input_layernorm", "scale"), (d,)),
            *attn,
            HFTensor(p + "self_attn.sinks", ("self_attn", "sinks"), (cfg.num_heads,)),
            HFTensor(p + "post_attention_layernorm.weight", ("post_attention_layernorm", "scale"), (d,)),
            HFTensor(p + "mlp.router.weight", ("mlp", "router", "kernel"), (d, e), True),
            HFTensor(p + "mlp.router.bias", ("mlp", "router", "bias"), (e,)),
            # (E, D, 2F) and (E, F, D) as jaxzero holds them, but gate and up interleaved
            HFTensor(
                x + "gate_up_proj", ("mlp", "gate_up", "kernel"), (e, d, 2 * f), interleaved=True, mxfp4=True
            ),
            HFTensor(x + "gate_up_proj_bias", ("mlp", "gate_up", "bias"), (e, 2 * f), interleaved=True),
            HFTensor(x + "down_proj", ("mlp", "down", "kernel"), (e, f, d), mxfp4=True),
            HFTensor(x + "down_proj_bias", ("mlp", "down", "bias"), (e, d)),
        )
        units.append(HFUnit(f"block {i}", tensors))
    units.append(_head_unit(cfg))
    return units


def _gpt2_units(cfg: ModelConfig) -> list[HFUnit]:
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    units = [
        HFUnit(
            "embed",
            (
                HFTensor("transformer.wte.weight", ("wte", "embedding"), (v, d)),
                HFTensor("transformer.wpe.weight", ("wpe", "embedding"), (cfg.max_seq_len, d)),
            ),
        )
    ]
    for i in range(cfg.num_layers):
        p = f"transformer.h.{i}."
        units.append(
            HFUnit(
                f"block {i}",
                (
                    HFTensor(p + "ln_1.weight", ("ln_1", "scale"), (d,)),
                    HFTensor(p + "ln_1.bias", ("ln_1", "bias"), (d,)),
                    HFTensor(p + "attn.c_attn.weight", ("attn", "c_attn", "kernel"), (d, 3 * d)),
                    HFTensor(p + "attn.c_attn.bias", ("attn", "c_attn", "bias"), (3 * d,)),
                    HFTensor(p + "attn.c_proj.weight", ("attn", "c_proj", "kernel"), (d, d)),
                    HFTensor(p + "attn.c_proj.bias", ("attn", "c_proj", "bias"), (d,)),
                    HFTensor(p + "ln_2.weight", ("ln_2", "scale"), (d,)),
                    HFTensor(p + "ln_2.bias", ("ln_2", "bias"), (d,)),
                    HFTensor(p + "mlp.c_fc.weight", ("mlp", "c_fc", "kernel"), (d, f)),
                    HFTensor(p + "mlp.c_fc.bias", ("mlp", "c_fc", "bias"), (f,)),
                    HFTensor(p + "mlp.c_proj.weight", ("mlp", "c_proj", "kernel"), (f, d)),
                    HFTensor(p + "mlp.c_proj.bias", ("mlp", "c_proj", "bias"), (d,)),
                ),
            )
        )
    units.append(
        HFUnit(
            "head",
            (
                HFTensor("transformer.ln_f.weight", ("ln_f", "scale"), (d,)),
                HFTensor("transformer.ln_f.bias", ("ln_f", "bias"), (d,)),
            ),
        )
    )
    return units


def hf_units(cfg: ModelConfig) -> list[HFUnit]:
    """embed, block 0 .. block L-1, head: the units of `ModelParams` in order, with their HF tensors."""
    build_model(cfg)  # validates the shape (divisibility, even head_dim, gpt2 multi-head) first
    families = {
        "llama": _llama_units,
        "gpt2": _gpt2_units,
        "gemma3": _gemma3_units,
        "gpt_oss": _gpt_oss_units,
    }
    return families[cfg.family](cfg)


def hf_tensor_names(cfg: ModelConfig) -> list[str]:
    """The HF names of every parameter of a `cfg`-shaped model, in save order (what `export_hf` writes)."""
    return [t.hf_name for u in hf_units(cfg) for t in u.tensors]


def unit_trees(params: ModelParams) -> Iterator[Any]:
    yield params.embed
    yield from params.blocks
    yield params.head


def leaf_paths(tree: Any, prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """(key path, leaf) of every leaf of a nested dict."""
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            yield from leaf_paths(v, (*prefix, str(k)))
    else:
        yield prefix, tree


def get_path(tree: Any, path: tuple[str, ...]) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def set_path(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value

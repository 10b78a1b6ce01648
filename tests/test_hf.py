"""Hugging Face interop against the real libraries: `safetensors`, `torch` (CPU) and `transformers`.

Tiny random models (hidden 64, 2 layers, vocab 128, 16 positions) are built and saved with transformers
and imported into jaxzero, and jaxzero params are exported and loaded by transformers; in both
directions jaxzero's float32 logits must match torch's. Models and checkpoints are built once per
module: importing transformers and building the models is most of this file's cost.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import struct
import zlib
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch
import transformers

from jaxzero.config import CheckpointError, ConfigError, ModelConfig
from jaxzero.interop import (
    export_hf,
    hf_config,
    hf_tensor_names,
    import_hf,
    load_hf_into,
    model_config_from_hf,
)
from jaxzero.interop.hf_variants import GRANITE_SCALARS
from jaxzero.interop.safetensors import (
    SafetensorsError,
    SafetensorsReader,
    SafetensorsWriter,
    TensorSpec,
    load_file,
    save_file,
)
from jaxzero.models import ModelParams, build_model, forward

VOCAB, HIDDEN, LAYERS, SEQ = 128, 64, 2, 16
TOKENS = np.random.default_rng(0).integers(0, VOCAB, size=(2, SEQ), dtype=np.int32)

LLAMA = ModelConfig(
    name="llama-hf-test",
    family="llama",
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    num_layers=LAYERS,
    num_heads=4,
    num_kv_heads=2,  # grouped-query attention
    intermediate_size=96,
    max_seq_len=SEQ,
    tie_embeddings=False,
    rope_theta=10000.0,
    norm_eps=1e-5,
    compute_dtype="float32",
    attention_impl="xla",
)
LLAMA_TIED = dataclasses.replace(LLAMA, name="llama-tied-hf-test", tie_embeddings=True, rope_theta=5e5)
GPT2 = ModelConfig(
    name="gpt2-hf-test",
    family="gpt2",
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    num_layers=LAYERS,
    num_heads=4,
    num_kv_heads=4,
    intermediate_size=4 * HIDDEN,
    max_seq_len=SEQ,
    tie_embeddings=True,
    norm_eps=1e-5,
    compute_dtype="float32",
    attention_impl="xla",
)
# Llama 3.1's rope scaling with a short original context (32), so that each band holds some of the 8
# frequencies of head_dim 16 (wavelengths 6.3 to 19869): kept below 8, interpolated up to 32, divided
# by the factor above.
LLAMA3 = dataclasses.replace(
    LLAMA,
    name="llama3-hf-test",
    rope_type="llama3",
    rope_factor=8.0,
    rope_low_freq_factor=1.0,
    rope_high_freq_factor=4.0,
    rope_original_max_len=32,
)
LLAMA_LINEAR = dataclasses.replace(LLAMA, name="llama-linear-hf-test", rope_type="linear", rope_factor=4.0)
QWEN2 = dataclasses.replace(
    LLAMA,
    name="qwen2-hf-test",
    tie_embeddings=True,
    rope_theta=1e6,
    norm_eps=1e-6,
    attention_bias=True,
    hf_model_type="qwen2",
)
# Mistral: every layer within a window of 4 of the 16 positions.
MISTRAL = dataclasses.replace(
    LLAMA, name="mistral-hf-test", rope_theta=1e6, sliding_window=4, hf_model_type="mistral"
)
# Qwen3: q/k norms, and heads twice as wide as hidden_size / num_heads (the 0.6B and 4B's shape).
QWEN3 = dataclasses.replace(
    LLAMA,
    name="qwen3-hf-test",
    tie_embeddings=True,
    rope_theta=1e6,
    norm_eps=1e-6,
    head_size=32,
    qk_norm=True,
    hf_model_type="qwen3",
)
# Qwen3-MoE: Qwen3's attention, every MLP 4 experts of width 24, top 2 renormalised (as the released
# ones); its dense intermediate_size only travels through the config. Mixtral: Mistral's attention
# without a window, 4 experts of the MLP's width, top 2.
QWEN3_MOE = dataclasses.replace(
    QWEN3,
    name="qwen3-moe-hf-test",
    tie_embeddings=False,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    norm_topk_prob=True,
    hf_model_type="qwen3_moe",
)
MIXTRAL = dataclasses.replace(
    LLAMA,
    name="mixtral-hf-test",
    rope_theta=1e6,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=LLAMA.intermediate_size,
    hf_model_type="mixtral",
)
# Phi-3: q, k, v fused into qkv_proj and gate, up into gate_up_proj; rope over the first half of each
# head (Phi-4-mini rotates 3/4); every layer within a window of 8 of the 16 positions.
PHI3 = dataclasses.replace(
    LLAMA,
    name="phi3-hf-test",
    fused_projections=True,
    partial_rotary_factor=0.5,
    sliding_window=8,
    hf_model_type="phi3",
)
# OLMo 2: RMSNorms after the attention's and the MLP's outputs, none before; q and k RMS-normalised
# over the whole projection (all heads at once) before the rotation.
OLMO2 = dataclasses.replace(
    LLAMA,
    name="olmo2-hf-test",
    rope_theta=5e5,
    norm_eps=1e-6,
    qk_norm=True,
    qk_norm_scope="projection",
    post_norm=True,
    hf_model_type="olmo2",
)
# Gemma 3: layer 0 local (window 4 of the 16 positions, rope base 1e4), layer 1 global (rope base 1e6
# scaled linearly by 4); heads of 32 where hidden / heads is 16; scores scaled by 24^-1/2; logits
# soft-capped at 2.
GEMMA3 = dataclasses.replace(
    LLAMA,
    name="gemma3-hf-test",
    family="gemma3",
    tie_embeddings=True,
    rope_theta=1e6,
    rope_type="linear",
    rope_factor=4.0,
    norm_eps=1e-6,
    head_size=32,
    sliding_window=4,
    sliding_window_pattern=2,
    rope_local_theta=1e4,
    query_pre_attn_scalar=24,
    final_logit_softcap=2.0,
    hf_model_type="gemma3_text",
)
# gpt-oss: q, k, v and o biased, a sink logit per head, heads of 32 where hidden / heads is 16, layer 0
# local (window 4 of the 16 positions), layer 1 global, the released yarn rope (its ramp keeps head
# dimensions 0-4 and scales those above 8 by 1/32), 4 biased experts of width 24, top 2.
GPT_OSS = dataclasses.replace(
    LLAMA,
    name="gpt-oss-hf-test",
    family="gpt_oss",
    head_size=32,
    attention_bias=True,
    intermediate_size=24,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    sliding_window=4,
    sliding_window_pattern=2,
    rope_theta=150000.0,
    rope_type="yarn",
    rope_factor=32.0,
    rope_original_max_len=4096,
    rope_truncate=False,
    hf_model_type="gpt_oss",
)
# Granite MoE: Mixtral's experts (4 of the MLP's width, top 2: the softmax over the top-2 logits), a
# tied head and the four scalars (scores times 1/8 where 1/sqrt(head_dim) is 1/4). Granite: the dense
# Llama block with the same scalars.
GRANITE_MOE = dataclasses.replace(
    LLAMA,
    name="granitemoe-hf-test",
    tie_embeddings=True,
    rope_theta=1e7,
    norm_eps=1e-6,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=LLAMA.intermediate_size,
    embedding_multiplier=12.0,
    residual_multiplier=0.22,
    attention_multiplier=0.125,
    logits_scaling=6.0,
    hf_model_type="granitemoe",
)
GRANITE = dataclasses.replace(
    GRANITE_MOE,
    name="granite-hf-test",
    num_experts=0,
    num_experts_per_tok=2,
    moe_intermediate_size=0,
    logits_scaling=16.0,
    hf_model_type="granite",
)
CONFIGS = {
    "llama": LLAMA,
    "llama_tied": LLAMA_TIED,
    "llama3": LLAMA3,
    "llama_linear": LLAMA_LINEAR,
    "qwen2": QWEN2,
    "mistral": MISTRAL,
    "qwen3": QWEN3,
    "qwen3_moe": QWEN3_MOE,
    "mixtral": MIXTRAL,
    "gemma3": GEMMA3,
    "gpt_oss": GPT_OSS,
    "gpt2": GPT2,
    "phi3": PHI3,
    "olmo2": OLMO2,
    "granitemoe": GRANITE_MOE,
    "granite": GRANITE,
}


def hf_rope(c: ModelConfig) -> dict[str, Any]:
    """transformers' rope_parameters for `c`, written out by hand (not by jaxzero's exporter)."""
    rope: dict[str, Any] = {"rope_type": c.rope_type, "rope_theta": c.rope_theta}
    if c.hf_model_type == "phi3":
        rope["partial_rotary_factor"] = c.partial_rotary_factor
    if c.rope_type == "linear":
        rope["factor"] = c.rope_factor
    if c.rope_type == "llama3":
        rope.update(
            factor=c.rope_factor,
            low_freq_factor=c.rope_low_freq_factor,
            high_freq_factor=c.rope_high_freq_factor,
            original_max_position_embeddings=c.rope_original_max_len,
        )
    if c.rope_type == "yarn":
        rope.update(
            factor=c.rope_factor,
            beta_fast=c.rope_beta_fast,
            beta_slow=c.rope_beta_slow,
            truncate=c.rope_truncate,
            original_max_position_embeddings=c.rope_original_max_len,
        )
    return rope


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| / max |b|: the error relative to the logits' scale."""
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


def jax_logits(cfg: ModelConfig, params: ModelParams) -> np.ndarray:
    """(2, SEQ, VOCAB) float32 logits of jaxzero's forward, float32 compute, full-precision matmuls."""
    cfg = dataclasses.replace(cfg, compute_dtype="float32", attention_impl="xla")
    with jax.default_matmul_precision("highest"):
        return np.asarray(forward(build_model(cfg), params, jnp.asarray(TOKENS)))


def torch_logits(model: torch.nn.Module) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(TOKENS).long()).logits.float().numpy()


def load_torch(path: Path, **kwargs: Any) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()


def torch_model(key: str) -> torch.nn.Module:
    """A random transformers model of CONFIGS[key]'s shape, with every parameter random.

    transformers initialises norm weights to 1 and biases to 0; those are re-drawn so that a norm or
    bias read from the wrong tensor could not go unnoticed.
    """
    torch.manual_seed(zlib.crc32(key.encode()))  # str hash() is salted per process: not reproducible
    c = CONFIGS[key]
    if c.family == "gemma3":
        model = transformers.Gemma3ForCausalLM(
            transformers.Gemma3TextConfig(
                vocab_size=VOCAB,
                hidden_size=HIDDEN,
                intermediate_size=c.intermediate_size,
                num_hidden_layers=LAYERS,
                num_attention_heads=c.num_heads,
                num_key_value_heads=c.num_kv_heads,
                head_dim=c.head_dim,
                max_position_embeddings=SEQ,
                rms_norm_eps=c.norm_eps,
                rope_parameters={
                    "full_attention": {
                        "rope_type": "linear",
                        "factor": c.rope_factor,
                        "rope_theta": c.rope_theta,
                    },
                    "sliding_attention": {"rope_type": "default", "rope_theta": c.rope_local_theta},
                },
                sliding_window=c.sliding_window,
                layer_types=["sliding_attention", "full_attention"],
                query_pre_attn_scalar=c.query_pre_attn_scalar,
                final_logit_softcapping=c.final_logit_softcap,
                tie_word_embeddings=True,
                pad_token_id=None,
                bos_token_id=None,
                eos_token_id=None,
            )
        )
    elif c.family == "gpt_oss":
        model = transformers.GptOssForCausalLM(
            transformers.GptOssConfig(
                vocab_size=VOCAB,
                hidden_size=HIDDEN,
                intermediate_size=c.moe_intermediate_size,
                num_hidden_layers=LAYERS,
                num_attention_heads=c.num_heads,
                num_key_value_heads=c.num_kv_heads,
                head_dim=c.head_dim,
                num_local_experts=c.num_experts,
                num_experts_per_tok=c.num_experts_per_tok,
                sliding_window=c.sliding_window,
                max_position_embeddings=SEQ,
                rms_norm_eps=c.norm_eps,
                rope_parameters=hf_rope(c),
                tie_word_embeddings=False,
                pad_token_id=None,
                bos_token_id=None,
                eos_token_id=None,
            )
        )
    elif c.family == "llama":
        common = dict(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=c.intermediate_size,
            num_hidden_layers=LAYERS,
            num_attention_heads=c.num_heads,
            num_key_value_heads=c.num_kv_heads,
            max_position_embeddings=SEQ,
            rms_norm_eps=c.norm_eps,
            rope_parameters=hf_rope(c),
            tie_word_embeddings=c.tie_embeddings,
            bos_token_id=None,
            eos_token_id=None,
        )
        if key == "qwen2":
            model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
        elif key == "qwen3":
            model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=c.head_dim))
        elif key == "qwen3_moe":
            moe = dict(num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok)
            model = transformers.Qwen3MoeForCausalLM(
                transformers.Qwen3MoeConfig(
                    **common, **moe, head_dim=c.head_dim, moe_intermediate_size=24, norm_topk_prob=True
                )
            )
        elif key == "mixtral":
            model = transformers.MixtralForCausalLM(
                transformers.MixtralConfig(**common, num_local_experts=c.num_experts, num_experts_per_tok=2)
            )
        elif key == "phi3":  # Phi3Config's pad_token_id defaults to 32000, past this vocabulary
            model = transformers.Phi3ForCausalLM(
                transformers.Phi3Config(**common, sliding_window=c.sliding_window, pad_token_id=None)
            )
        elif key == "olmo2":
            model = transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**common, pad_token_id=None))
        elif key in ("granitemoe", "granite"):
            scalars = {k: getattr(c, k) for k in GRANITE_SCALARS}
            if key == "granite":
                model = transformers.GraniteForCausalLM(transformers.GraniteConfig(**common, **scalars))
            else:
                moe = dict(num_local_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok)
                model = transformers.GraniteMoeForCausalLM(
                    transformers.GraniteMoeConfig(**common, **moe, **scalars)
                )
        elif key == "mistral":
            model = transformers.MistralForCausalLM(
                transformers.MistralConfig(**common, sliding_window=c.sliding_window)
            )
        else:
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=4, n_positions=SEQ, bos_token_id=None
            )
        )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(p))
            elif name.endswith("_bias"):  # gpt-oss's experts' biases, (E, out)
                p.copy_(0.1 * torch.randn_like(p))
            elif key.startswith("granite") and name.endswith(
                ("q_proj.weight", "k_proj.weight", "o_proj.weight", "router.weight")
            ):
                # scores and router logits far from uniform: the attention's scale and the masked
                # tokens' share of the load-balancing loss move the logits and the loss
                p.mul_(10.0)
    return model.eval()


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, np.ndarray]]:
    """{key: (directory saved by transformers' save_pretrained, torch float32 logits of TOKENS)}."""
    out = {}
    for key in CONFIGS:
        model = torch_model(key)
        path = tmp_path_factory.mktemp(f"hf-{key}")
        model.save_pretrained(path)
        out[key] = (path, torch_logits(model))
    return out


@pytest.fixture(scope="module")
def jax_params() -> dict[str, ModelParams]:
    """Random float32 jaxzero params per config, with random norm scales and biases (see torch_model)."""

    def perturb(path: tuple[Any, ...], x: jax.Array) -> jax.Array:
        if x.ndim != 1 and not jax.tree_util.keystr(path).endswith("['bias']"):  # gpt-oss's experts'
            return x
        k = jax.random.fold_in(jax.random.key(1), zlib.crc32(jax.tree_util.keystr(path).encode()))
        return x + 0.1 * jax.random.normal(k, x.shape)

    out = {}
    for i, (key, cfg) in enumerate(CONFIGS.items()):
        params = build_model(cfg).init(jax.random.key(i))
        out[key] = jax.tree_util.tree_map_with_path(perturb, params)
    return out


# -------------------------------------------------------------------------------------------------
# safetensors
# -------------------------------------------------------------------------------------------------


def sample_tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "f16": rng.normal(size=(3, 5)).astype(np.float16),  # first, so that a naive layout misaligns f32
        "f32": rng.normal(size=(4, 7)).astype(np.float32),
        "bf16": rng.normal(size=(2, 3, 4)).astype(ml_dtypes.bfloat16),
        "i64": np.arange(6, dtype=np.int64).reshape(2, 3),
        "i32": np.arange(5, dtype=np.int32),
        "bool": np.array([True, False, True]),
        "scalar": np.array(3.5, dtype=np.float32),
        "empty": np.zeros((0, 4), dtype=np.float32),
        "big_endian": np.arange(4, dtype=">f4"),
    }


def test_safetensors_round_trip_and_alignment(tmp_path: Path) -> None:
    tensors = sample_tensors()
    path = save_file(tensors, tmp_path / "x.safetensors", metadata={"format": "pt", "note": "hi"})
    with SafetensorsReader(path) as r:
        assert dict(r.metadata) == {"format": "pt", "note": "hi"}
        assert set(r) == set(tensors)
        for name, want in tensors.items():
            got = r[name]
            assert got.shape == want.shape and got.dtype == want.dtype.newbyteorder("<"), name
            np.testing.assert_array_equal(got, want)
            assert not got.flags.writeable  # a view of the read-only mapping, not a copy
            info = r.tensors[name]
            # Every tensor is aligned to its itemsize (header padded to 8, tensors by decreasing size).
            assert (r.data_start + info.begin) % got.dtype.itemsize == 0, name
        base = r["f32"]
        while base.base is not None and not isinstance(base, np.memmap):
            base = base.base
        assert isinstance(base, np.memmap)  # memory-mapped, not read into RAM
    assert (r.data_start - 8) % 8 == 0


def test_safetensors_interop_with_reference_library(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    f32 = {"a": rng.normal(size=(5, 3)).astype(np.float32), "b.c": rng.normal(size=(7,)).astype(np.float32)}
    bf16 = {"w": rng.normal(size=(4, 6)).astype(ml_dtypes.bfloat16)}

    # Ours -> theirs (safetensors.numpy has no bfloat16; safetensors.torch does).
    save_file(f32, tmp_path / "ours_f32.safetensors")
    for k, v in safetensors.numpy.load_file(tmp_path / "ours_f32.safetensors").items():
        np.testing.assert_array_equal(v, f32[k])
    save_file(bf16, tmp_path / "ours_bf16.safetensors")
    theirs = safetensors.torch.load_file(tmp_path / "ours_bf16.safetensors")
    assert theirs["w"].dtype == torch.bfloat16
    np.testing.assert_array_equal(theirs["w"].float().numpy(), bf16["w"].astype(np.float32))

    # Theirs -> ours.
    safetensors.numpy.save_file(f32, tmp_path / "theirs_f32.safetensors", metadata={"format": "np"})
    got = load_file(tmp_path / "theirs_f32.safetensors")
    assert set(got) == set(f32)
    for k in f32:
        np.testing.assert_array_equal(got[k], f32[k])
    w = torch.from_numpy(bf16["w"].astype(np.float32)).to(torch.bfloat16)
    safetensors.torch.save_file({"w": w, "x": torch.ones(3)}, tmp_path / "theirs_bf16.safetensors")
    with SafetensorsReader(tmp_path / "theirs_bf16.safetensors") as r:
        assert r.tensors["w"].dtype == "BF16" and r["w"].dtype == np.dtype(ml_dtypes.bfloat16)
        np.testing.assert_array_equal(r["w"], bf16["w"])
        np.testing.assert_array_equal(r["x"], np.ones(3, np.float32))


def test_streaming_writer_any_order_and_failures(tmp_path: Path) -> None:
    specs = [
        TensorSpec("a", np.dtype(np.float32), (2, 2)),
        TensorSpec("b", np.dtype(ml_dtypes.bfloat16), (3,)),
    ]
    path = tmp_path / "s.safetensors"
    with SafetensorsWriter(path, specs) as w:
        w.write("b", np.ones(3, ml_dtypes.bfloat16))  # out of plan order
        w.write("a", np.eye(2, dtype=np.float32))
        assert not path.exists()  # only the .partial file until closed
    np.testing.assert_array_equal(load_file(path)["a"], np.eye(2))

    w = SafetensorsWriter(tmp_path / "bad.safetensors", specs)
    with pytest.raises(SafetensorsError, match=r"planned as F32 \(2, 2\) but got float64"):
        w.write("a", np.eye(2))
    with pytest.raises(SafetensorsError, match="'c' was not in the plan"):
        w.write("c", np.eye(2, dtype=np.float32))
    w.write("a", np.eye(2, dtype=np.float32))
    with pytest.raises(SafetensorsError, match=r"planned tensors were written: \['b'\]"):
        w.close()
    assert not list(tmp_path.glob("bad.safetensors*"))  # neither the file nor its .partial remain

    with (
        pytest.raises(RuntimeError, match="boom"),
        SafetensorsWriter(tmp_path / "exc.safetensors", specs) as w,
    ):
        w.write("a", np.eye(2, dtype=np.float32))
        raise RuntimeError("boom")
    assert not list(tmp_path.glob("exc.safetensors*"))


def _raw_file(path: Path, header: dict[str, Any], data: bytes) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def test_safetensors_corrupt_files_name_the_file(tmp_path: Path) -> None:
    good = save_file({"w": np.arange(16, dtype=np.float32)}, tmp_path / "good.safetensors")
    blob = good.read_bytes()

    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(blob[:-4])
    with pytest.raises(
        SafetensorsError, match=r"truncated\.safetensors.*'w' ends at data offset 64.*truncated"
    ):
        SafetensorsReader(truncated)

    short = tmp_path / "short.safetensors"
    short.write_bytes(blob[:5])
    with pytest.raises(SafetensorsError, match=r"short\.safetensors: 5 bytes is too short"):
        SafetensorsReader(short)

    cut_header = tmp_path / "cut_header.safetensors"
    cut_header.write_bytes(blob[:20])
    with pytest.raises(SafetensorsError, match=r"cut_header\.safetensors: header size field says \d+ bytes"):
        SafetensorsReader(cut_header)

    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(struct.pack("<Q", 6) + b"{nope}" + b"\0" * 8)
    with pytest.raises(SafetensorsError, match=r"garbage\.safetensors: the header is not valid UTF-8 JSON"):
        SafetensorsReader(garbage)

    header = {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}
    oob = _raw_file(tmp_path / "oob.safetensors", header, b"\0" * 8)
    with pytest.raises(
        SafetensorsError, match=r"oob\.safetensors.*ends at data offset 16 but the file holds only 8"
    ):
        SafetensorsReader(oob)

    header = {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}
    size = _raw_file(tmp_path / "size.safetensors", header, b"\0" * 12)
    with pytest.raises(SafetensorsError, match=r"needs 16 bytes but its data_offsets \[0, 12\] span 12"):
        SafetensorsReader(size)

    header = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
    }
    overlap = _raw_file(tmp_path / "overlap.safetensors", header, b"\0" * 12)
    with pytest.raises(SafetensorsError, match=r"overlap\.safetensors: tensor 'b'.*overlaps"):
        SafetensorsReader(overlap)

    header = {"w": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 1]}}
    with pytest.raises(SafetensorsError, match="dtype 'Q4'; supported: F64, F32"):
        SafetensorsReader(_raw_file(tmp_path / "q4.safetensors", header, b"\0"))


# -------------------------------------------------------------------------------------------------
# transformers -> jaxzero
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", list(CONFIGS))
def test_import_matches_transformers_logits(key: str, hf_checkpoints: dict) -> None:
    path, want = hf_checkpoints[key]
    cfg, params = import_hf(path)
    expected = dataclasses.replace(
        CONFIGS[key], name=f"hf:{path.name}", compute_dtype="bfloat16", attention_impl="auto"
    )
    assert cfg == expected
    leaves = jax.tree.leaves(params)
    assert all(type(x) is np.ndarray and x.dtype == np.float32 and x.flags.writeable for x in leaves)
    assert rel_err(jax_logits(cfg, params), want) < 1e-4


def test_load_hf_into_checks_every_shape_field(hf_checkpoints: dict) -> None:
    path, want = hf_checkpoints["llama"]
    run_cfg = dataclasses.replace(LLAMA, name="run", max_seq_len=4096, init_std=0.01)  # run-only fields
    params = load_hf_into(run_cfg, path)
    assert rel_err(jax_logits(run_cfg, params), want) < 1e-4

    wrong = dataclasses.replace(LLAMA, hidden_size=128, num_kv_heads=4, tie_embeddings=True, rope_theta=1e6)
    with pytest.raises(ConfigError) as e:
        load_hf_into(wrong, path)
    msg = str(e.value)
    for field, ours, theirs in [
        ("hidden_size", 128, 64),
        ("num_kv_heads", 4, 2),
        ("tie_embeddings", True, False),
        ("rope_theta", 1e6, 10000.0),
    ]:
        assert f"model.{field}: run config has {ours!r}, checkpoint has {theirs!r}" in msg
    assert "num_heads" not in msg and "vocab_size" not in msg
    # rope_theta is a numerics field: allowed to differ on request, shapes never.
    with pytest.raises(ConfigError, match="hidden_size") as e:
        load_hf_into(wrong, path, check_numerics=False)
    assert "rope_theta" not in str(e.value)
    load_hf_into(dataclasses.replace(LLAMA, rope_theta=1e6), path, check_numerics=False)

    with pytest.raises(ConfigError, match=r"model.family: run config has 'gpt2', checkpoint has 'llama'"):
        load_hf_into(GPT2, path)
    # A mixture of experts' routing is part of its shape: another top-k is refused, numerics or not.
    moe_path, _ = hf_checkpoints["qwen3_moe"]
    with pytest.raises(ConfigError, match="model.num_experts_per_tok: run config has 1, checkpoint has 2"):
        load_hf_into(dataclasses.replace(QWEN3_MOE, num_experts_per_tok=1), moe_path, check_numerics=False)


def _rewrite_checkpoint(src: Path, dst: Path, edit: Any) -> Path:
    """Copy a single-file checkpoint, passing its {name: array} through `edit` (and config.json as is)."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = {k: np.array(v) for k, v in load_file(src / "model.safetensors").items()}
    save_file(edit(tensors), dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_load_hf_into_compares_granites_scalars(hf_checkpoints: dict) -> None:
    """A run config without Granite's scalars computes something else than the checkpoint: refused,
    naming each, unless the numerics are left unchecked on purpose."""
    path, want = hf_checkpoints["granitemoe"]
    assert rel_err(jax_logits(GRANITE_MOE, load_hf_into(GRANITE_MOE, path)), want) < 1e-4
    plain = dataclasses.replace(GRANITE_MOE, embedding_multiplier=1.0, logits_scaling=1.0)
    with pytest.raises(ConfigError) as e:
        load_hf_into(plain, path)
    assert "model.embedding_multiplier: run config has 1.0, checkpoint has 12.0" in str(e.value)
    assert "model.logits_scaling: run config has 1.0, checkpoint has 6.0" in str(e.value)
    load_hf_into(plain, path, check_numerics=False)


def test_import_legacy_gpt2_layout(hf_checkpoints: dict, tmp_path: Path) -> None:
    """openai-community/gpt2's files: no "transformer." prefix, causal-mask buffers, a tied lm_head copy."""
    path, want = hf_checkpoints["gpt2"]

    def legacy(t: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = {k.removeprefix("transformer."): v for k, v in t.items()}
        for i in range(LAYERS):
            out[f"h.{i}.attn.bias"] = np.tril(np.ones((1, 1, SEQ, SEQ), np.float32))
        out["lm_head.weight"] = out["wte.weight"]
        return out

    legacy_dir = _rewrite_checkpoint(path, tmp_path / "legacy", legacy)
    cfg, params = import_hf(legacy_dir)
    assert rel_err(jax_logits(cfg, params), want) < 1e-4
    # transformers reads the same files to the same logits.
    assert rel_err(torch_logits(load_torch(legacy_dir)), want) < 1e-6


def test_import_legacy_llama_config(hf_checkpoints: dict, tmp_path: Path) -> None:
    """transformers 4 configs: top-level rope_theta, rope_scaling null, torch_dtype; bf16 weights."""
    path, want = hf_checkpoints["llama_tied"]
    d = json.loads((path / "config.json").read_text())
    d.pop("rope_parameters")
    d.pop("dtype", None)
    d.update(rope_theta=LLAMA_TIED.rope_theta, rope_scaling=None, torch_dtype="bfloat16", head_dim=None)
    legacy_dir = _rewrite_checkpoint(
        path, tmp_path / "legacy", lambda t: {k: v.astype(ml_dtypes.bfloat16) for k, v in t.items()}
    )
    (legacy_dir / "config.json").write_text(json.dumps(d))
    cfg, params = import_hf(legacy_dir)
    assert cfg.rope_theta == LLAMA_TIED.rope_theta and cfg.tie_embeddings
    assert rel_err(jax_logits(cfg, params), want) < 2e-2


# -------------------------------------------------------------------------------------------------
# jaxzero -> transformers
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", list(CONFIGS))
def test_export_loads_in_transformers(key: str, jax_params: dict, tmp_path: Path) -> None:
    cfg, params = CONFIGS[key], jax_params[key]
    want = jax_logits(cfg, params)

    paths = export_hf(params, cfg, tmp_path / "f32", dtype="float32")
    assert [p.name for p in paths] == ["config.json", "model.safetensors"]
    with SafetensorsReader(paths[1]) as r:
        assert list(r.tensors) and set(r) == set(hf_tensor_names(cfg))
        assert r.metadata["format"] == "pt"  # transformers 4 refuses metadata without it
    model = load_torch(tmp_path / "f32")
    want_class = {
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM",
        "mixtral": "MixtralForCausalLM",
        "phi3": "Phi3ForCausalLM",
        "olmo2": "Olmo2ForCausalLM",
        "gemma3_text": "Gemma3ForCausalLM",
        "gpt_oss": "GptOssForCausalLM",
        "granitemoe": "GraniteMoeForCausalLM",
        "granite": "GraniteForCausalLM",
    }.get(cfg.hf_model_type, "GPT2LMHeadModel" if cfg.family == "gpt2" else "LlamaForCausalLM")
    assert type(model).__name__ == want_class
    if cfg.tie_embeddings:
        emb = model.get_input_embeddings().weight
        assert model.get_output_embeddings().weight.data_ptr() == emb.data_ptr()
    assert rel_err(torch_logits(model), want) < 1e-4

    # bf16: transformers 5 loads in the checkpoint's dtype by default; in float32 it computes with the
    # bf16-rounded weights, which must still agree with jaxzero's float32 logits to bf16 precision.
    export_hf(params, cfg, tmp_path / "bf16")
    assert load_torch(tmp_path / "bf16").dtype == torch.bfloat16
    model = load_torch(tmp_path / "bf16", dtype=torch.float32)
    assert rel_err(torch_logits(model), want) < 2e-2

    # And back: import of our own export is exact in float32.
    cfg2, params2 = import_hf(tmp_path / "f32")
    assert cfg2 == dataclasses.replace(cfg, name="hf:f32", compute_dtype="bfloat16", attention_impl="auto")
    for a, b in zip(jax.tree.leaves(params2), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, np.asarray(b))


def test_sharded_export(jax_params: dict, tmp_path: Path) -> None:
    cfg, params = LLAMA, jax_params["llama"]
    embed_bytes = VOCAB * HIDDEN * 4
    paths = export_hf(params, cfg, tmp_path / "ckpt", dtype="float32", max_shard_bytes=embed_bytes + 1024)
    names = [p.name for p in paths]
    n = len(names) - 2
    assert n >= 3
    assert names == ["config.json", *[f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]] + [
        "model.safetensors.index.json"
    ]
    assert all(p.stat().st_size <= embed_bytes + 1024 + 4096 for p in paths[1:-1])  # + header
    index = json.loads(paths[-1].read_text())
    assert set(index["weight_map"]) == set(hf_tensor_names(cfg))
    assert index["metadata"]["total_size"] == sum(np.asarray(x).size * 4 for x in jax.tree.leaves(params))
    assert rel_err(torch_logits(load_torch(tmp_path / "ckpt")), jax_logits(cfg, params)) < 1e-4
    _, back = import_hf(tmp_path / "ckpt")
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, np.asarray(b))

    # A re-export with fewer shards must not leave stale shards behind.
    with pytest.raises(FileExistsError, match="pass overwrite=True"):
        export_hf(params, cfg, tmp_path / "ckpt")
    export_hf(params, cfg, tmp_path / "ckpt", overwrite=True)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        ".jaxzero-export",  # the export's marker (jaxzero.storage.export_dir)
        "config.json",
        "model.safetensors",
    ]


def test_hf_config_round_trip() -> None:
    for cfg in CONFIGS.values():
        d = hf_config(cfg, "float32")
        back = model_config_from_hf(d, name=cfg.name)
        assert back == dataclasses.replace(cfg, compute_dtype="bfloat16", attention_impl="auto")
        # transformers parses it to the same shape.
        hf = transformers.AutoConfig.for_model(**d)
        if cfg.family == "llama":
            assert (hf.hidden_size, hf.num_key_value_heads, hf.head_dim) == (
                HIDDEN,
                cfg.num_kv_heads,
                cfg.head_dim,
            )
            assert cfg.head_dim == (32 if cfg.qk_norm and cfg.qk_norm_scope == "head" else 16)
            assert hf.rope_parameters == hf_rope(cfg)
            assert getattr(hf, "sliding_window", None) == (cfg.sliding_window or None)
        elif cfg.family == "gemma3":
            assert hf.layer_types == ["sliding_attention", "full_attention"] and hf.sliding_window == 4
            assert hf.rope_parameters["full_attention"]["factor"] == cfg.rope_factor
            assert hf.rope_parameters["sliding_attention"]["rope_theta"] == cfg.rope_local_theta
        elif cfg.family == "gpt_oss":
            assert hf.layer_types == ["sliding_attention", "full_attention"] and hf.sliding_window == 4
            assert (hf.head_dim, hf.num_local_experts, hf.intermediate_size) == (32, 4, 24)
            assert hf.rope_parameters == hf_rope(cfg)
        else:
            assert (hf.n_embd, hf.n_inner, hf.activation_function) == (HIDDEN, 4 * HIDDEN, "gelu_new")


# -------------------------------------------------------------------------------------------------
# Errors
# -------------------------------------------------------------------------------------------------


# The released config.json files of Qwen/Qwen3-30B-A3B and mistralai/Mixtral-8x7B-v0.1 (written by
# transformers 4.51 and 4.36: the Hub's spelling), less their token ids.
QWEN3_30B_A3B_JSON = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "decoder_sparse_step": 1,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
    "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
    "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 151936,
}  # fmt: skip
MIXTRAL_8X7B_JSON = {
    "architectures": ["MixtralForCausalLM"], "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
    "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False, "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": None,
    "tie_word_embeddings": False, "vocab_size": 32000,
}  # fmt: skip


# The released config.json files of microsoft/Phi-3-mini-4k-instruct and allenai/OLMo-2-1124-7B
# (transformers 4.40 and 4.47's spelling), less their token ids; Phi-4 and OLMo 2 13B / 32B differ
# from them only in the numbers.
PHI3_MINI_JSON = {
    "architectures": ["Phi3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "embd_pdrop": 0.0, "hidden_act": "silu", "hidden_size": 3072, "initializer_range": 0.02,
    "intermediate_size": 8192, "max_position_embeddings": 4096, "model_type": "phi3",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
    "original_max_position_embeddings": 4096, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 10000.0, "sliding_window": 2047, "tie_word_embeddings": False,
    "vocab_size": 32064,
}  # fmt: skip
OLMO2_7B_JSON = {
    "architectures": ["Olmo2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 11008,
    "max_position_embeddings": 4096, "model_type": "olmo2", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 32, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 500000, "tie_word_embeddings": False, "vocab_size": 100352,
}  # fmt: skip
PHI4_JSON = {
    **PHI3_MINI_JSON, "hidden_size": 5120, "intermediate_size": 17920, "max_position_embeddings": 16384,
    "num_attention_heads": 40, "num_hidden_layers": 40, "num_key_value_heads": 10,
    "original_max_position_embeddings": 16384, "rope_theta": 250000, "sliding_window": None,
    "vocab_size": 100352,
}  # fmt: skip


# ibm-granite/granite-3.1-1b-a400m-instruct's config.json (transformers 4.47), less its token ids; the
# 3B-A800M differs in the numbers (its router_aux_loss_coef taken as the 1B's, the loss off in both);
# granite-3.1-8b's as granite-3.3-8b's (the same architecture) with 3.1's vocabulary.
GRANITE_1B_A400M_JSON = {
    "architectures": ["GraniteMoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attention_multiplier": 0.015625, "embedding_multiplier": 12.0, "hidden_act": "silu",
    "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 512, "logits_scaling": 6.0,
    "max_position_embeddings": 131072, "model_type": "granitemoe", "num_attention_heads": 16,
    "num_experts_per_tok": 8, "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32,
    "output_router_logits": False, "residual_multiplier": 0.22, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1500000.0, "router_aux_loss_coef": 0.0, "tie_word_embeddings": True, "vocab_size": 49155,
}  # fmt: skip
GRANITE_3B_A800M_JSON = {
    **GRANITE_1B_A400M_JSON, "hidden_size": 1536, "num_attention_heads": 24, "num_hidden_layers": 32,
    "num_local_experts": 40, "rope_theta": 10000000.0,
}  # fmt: skip
GRANITE_8B_JSON = {
    "architectures": ["GraniteForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attention_multiplier": 0.0078125, "embedding_multiplier": 12.0, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12800, "logits_scaling": 16.0,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "granite", "num_attention_heads": 32,
    "num_hidden_layers": 40, "num_key_value_heads": 8, "residual_multiplier": 0.22, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 10000000.0, "tie_word_embeddings": True, "vocab_size": 49155,
}  # fmt: skip


@pytest.mark.parametrize(
    "name, released",
    [
        ("qwen3-30b-a3b", QWEN3_30B_A3B_JSON),
        ("mixtral-8x7b", MIXTRAL_8X7B_JSON),
        ("granite-3.1-1b-a400m", GRANITE_1B_A400M_JSON),
        ("granite-3.1-3b-a800m", GRANITE_3B_A800M_JSON),
        ("granite-3.1-8b", GRANITE_8B_JSON),
        ("phi-3-mini", PHI3_MINI_JSON),
        ("phi-4", PHI4_JSON),
        ("olmo-2-7b", OLMO2_7B_JSON),
    ],
)
def test_released_configs_import_as_their_named_sizes(name: str, released: dict) -> None:
    """The named size is the released config, a mixture of experts' load-balancing coefficient
    included; import trains with it only where the config turns the loss on (output_router_logits),
    as transformers does."""
    named = ModelConfig.named(name)
    if not named.num_experts:
        assert model_config_from_hf(released, name=name) == named
        return
    assert named.router_aux_loss_coef == released["router_aux_loss_coef"]
    assert model_config_from_hf(released, name=name) == dataclasses.replace(named, router_aux_loss_coef=0.0)
    assert model_config_from_hf({**released, "output_router_logits": True}, name=name) == named


def test_the_load_balancing_coefficient_survives_an_export_round_trip() -> None:
    """Export writes output_router_logits and the coefficient back; with a coefficient of 0 it writes
    transformers' defaults (the loss off), so either objective comes back from the config."""
    for coef in (0.0, 0.02):
        for cfg in (dataclasses.replace(ModelConfig.named(n), router_aux_loss_coef=coef) for n in MOE_SIZES):
            d = hf_config(cfg)
            assert d["output_router_logits"] is (coef > 0)
            assert d["router_aux_loss_coef"] == (coef or 0.001)
            assert model_config_from_hf(d, name=cfg.name).router_aux_loss_coef == coef
    bad = {**QWEN3_30B_A3B_JSON, "output_router_logits": True, "router_aux_loss_coef": -1}
    with pytest.raises(ConfigError, match="router_aux_loss_coef=-1 must be a number >= 0"):
        model_config_from_hf(bad)
    from jaxzero.config.checks import validate_model

    with pytest.raises(ConfigError, match="model.router_aux_loss_coef=-0.5 must be a finite number >= 0"):
        validate_model(dataclasses.replace(ModelConfig.named("qwen3-30b-a3b"), router_aux_loss_coef=-0.5))


MOE_SIZES = ("qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x7b", "gpt-oss-20b", "granite-3.1-3b-a800m")


def test_unsupported_configs_are_refused() -> None:
    llama = hf_config(LLAMA)
    cases = [
        ({**llama, "model_type": "gemma"}, "model_type='gemma' is not supported"),
        (
            {**llama, "rope_parameters": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 5e5}},
            "rope type 'yarn'",
        ),
        (
            {**llama, "rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
            "rope type 'dynamic'",
        ),
        (
            {**llama, "rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}},
            "rope low_freq_factor=None must be a positive number",
        ),
        ({**llama, "attention_bias": True}, "attention_bias=true"),
        ({**hf_config(QWEN2), "architectures": ["LlamaForCausalLM"]}, "LlamaForCausalLM"),
        ({**llama, "head_dim": 32}, "head_dim=32 != hidden_size/num_attention_heads = 64/4"),
        ({**llama, "hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({**llama, "architectures": ["LlamaForSequenceClassification"]}, "LlamaForSequenceClassification"),
        ({**llama, "num_attention_heads": 5, "head_dim": None}, "must be divisible"),
        ({**hf_config(GPT2), "activation_function": "relu"}, "activation_function='relu'"),
        ({**hf_config(GPT2), "tie_word_embeddings": False}, "tie_word_embeddings=false"),
        # Dense layers among the sparse ones, and router noise: no released checkpoint has them.
        ({**hf_config(QWEN3_MOE), "mlp_only_layers": [1]}, "mlp_only_layers=[1]"),
        ({**hf_config(QWEN3_MOE), "decoder_sparse_step": 2}, "decoder_sparse_step=2"),
        ({**hf_config(MIXTRAL), "router_jitter_noise": 0.01}, "router_jitter_noise=0.01"),
        ({**hf_config(MIXTRAL), "num_experts_per_tok": 5}, "num_experts_per_tok=5"),
        # Granite's biases would also bias o_proj (and the MLP); its scalars are positive.
        (
            {**GRANITE_1B_A400M_JSON, "attention_bias": True},
            "attention_bias=true (biases on q, k, v and o_proj",
        ),
        ({**GRANITE_8B_JSON, "mlp_bias": True}, "mlp_bias=true (biases on the MLP"),
        ({**GRANITE_8B_JSON, "logits_scaling": 0}, "logits_scaling=0 must be a positive number"),
        # LongRoPE (Phi-3-mini-128k, Phi-3.5, Phi-4-mini) in either spelling; OLMo 2's biases on q, k, v, o.
        (
            {**PHI3_MINI_JSON, "rope_scaling": {"type": "su", "long_factor": [1.0], "short_factor": [1.0]}},
            "rope type 'su' (LongRoPE's",
        ),
        ({**PHI3_MINI_JSON, "rope_scaling": {"rope_type": "longrope"}}, "rope type 'longrope'"),
        ({**OLMO2_7B_JSON, "attention_bias": True}, "attention_bias=true"),
        ({**PHI3_MINI_JSON, "head_dim": 128}, "head_dim=128 != hidden_size/num_attention_heads"),
    ]
    for d, match in cases:
        with pytest.raises(ConfigError, match=match.replace("(", r"\(").replace("[", r"\[")):
            model_config_from_hf(d)
    # Several problems are reported together.
    with pytest.raises(ConfigError, match="attention_bias=true.*mlp_bias=true"):
        model_config_from_hf({**llama, "attention_bias": True, "mlp_bias": True})


def test_import_reports_missing_unexpected_and_misshaped_tensors(
    hf_checkpoints: dict, tmp_path: Path
) -> None:
    path, _ = hf_checkpoints["llama"]

    def damage(t: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        del t["model.layers.1.mlp.up_proj.weight"]
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:16]
        t["model.layers.0.self_attn.q_proj.bias"] = np.zeros(64, np.float32)
        return t

    bad = _rewrite_checkpoint(path, tmp_path / "bad", damage)
    with pytest.raises(CheckpointError) as e:
        import_hf(bad)
    msg = str(e.value)
    assert "missing tensors (1): ['model.layers.1.mlp.up_proj.weight']" in msg
    assert "unexpected tensors (1): ['model.layers.0.self_attn.q_proj.bias']" in msg
    assert "model.layers.0.self_attn.k_proj.weight: checkpoint [16, 64], config needs [32, 64]" in msg

    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text((path / "config.json").read_text())
    (tmp_path / "empty" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"neither model.safetensors nor .*pytorch_model.bin"):
        import_hf(tmp_path / "empty")
    with pytest.raises(ConfigError, match="no HF config"):
        import_hf(tmp_path)


def test_a_block_variant_no_transformers_class_computes_is_not_exported() -> None:
    """Partial rotary without Phi-3's fused projections, or OLMo 2's norms after each sub-block with
    per-head q/k norms, train (model.hf_model_type='') but have no transformers class to export as."""
    with pytest.raises(ConfigError, match="model.partial_rotary_factor=0.5: no llama model of transformers"):
        hf_config(dataclasses.replace(LLAMA, partial_rotary_factor=0.5))
    with pytest.raises(ConfigError, match="model.hf_model_type='olmo2' needs model.qk_norm_scope=projection"):
        hf_config(dataclasses.replace(OLMO2, qk_norm_scope="head", hf_model_type=""))


def test_export_rejects_params_that_do_not_match_the_config(jax_params: dict, tmp_path: Path) -> None:
    params = jax_params["llama"]
    with pytest.raises(ValueError, match=r"head: missing lm_head/kernel \(-> lm_head.weight\)"):
        export_hf(jax_params["llama_tied"], LLAMA, tmp_path / "a")
    with pytest.raises(ValueError, match="head: unexpected lm_head/kernel"):
        export_hf(params, LLAMA_TIED, tmp_path / "b")
    wide = dataclasses.replace(LLAMA, intermediate_size=128)
    with pytest.raises(
        ValueError, match=r"block 0: mlp/gate_proj/kernel has shape \(64, 96\), the config needs"
    ):
        export_hf(params, wide, tmp_path / "c")
    with pytest.raises(ValueError, match="dtype='int8' is not one of"):
        export_hf(params, LLAMA, tmp_path / "d", dtype="int8")
    assert not any((tmp_path / x).exists() for x in "abcd")  # nothing written on a rejected export


# -------------------------------------------------------------------------------------------------
# Rope scaling, biases and sliding windows
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key",
    [
        "llama3",
        "llama_linear",
        "qwen2",
        "qwen3",
        "gemma3",
        "gpt_oss",
        "phi3",
        "olmo2",
        "granitemoe",
        "mistral",
    ],
)
def test_what_the_families_add_changes_the_logits(key: str, hf_checkpoints: dict) -> None:
    """The import tests could not pass without each feature: the checkpoint computed without its rope
    scaling, or without its q, k, v biases, misses transformers' logits by over 10x the import
    tolerance (random weights attend almost uniformly, so positions move the logits little)."""
    path, want = hf_checkpoints[key]
    cfg, params = import_hf(path)
    assert rel_err(jax_logits(cfg, params), want) < 1e-4
    if key == "qwen2":
        for block in params.blocks:
            for proj in ("q_proj", "k_proj", "v_proj"):
                block["self_attn"][proj]["bias"][...] = 0.0
        plain = cfg
    elif key == "qwen3":
        # The q/k norms make each head's scale irrelevant: q and k three times larger, same logits;
        # then the norms' own weights set to one.
        for block in params.blocks:
            for proj in ("q_proj", "k_proj"):
                block["self_attn"][proj]["kernel"] *= 3.0
        assert rel_err(jax_logits(cfg, params), want) < 1e-4
        for block in params.blocks:
            for norm in ("q_norm", "k_norm"):
                block["self_attn"][norm]["scale"][...] = 1.0
        plain = cfg
    elif key == "phi3":  # rope over half of each head, not all of it; then the window
        wide = dataclasses.replace(cfg, sliding_window=SEQ)
        assert rel_err(jax_logits(wide, params), want) > 1e-3
        plain = dataclasses.replace(cfg, partial_rotary_factor=1.0)
    elif key == "mistral":  # the window, every layer's
        plain = dataclasses.replace(cfg, sliding_window=SEQ)
    elif key == "olmo2":
        # q and k normalised over the whole projection: once q and k are far above the norms' epsilon
        # (OLMo 2 has no norm before the attention, so its q and k are small here), all of them three
        # times larger give the same logits; one head's q alone three times larger does not (a norm
        # over each head would undo that).
        for block in params.blocks:
            for proj in ("q_proj", "k_proj"):
                block["self_attn"][proj]["kernel"] *= 100.0
        large = jax_logits(cfg, params)
        for block in params.blocks:
            for proj in ("q_proj", "k_proj"):
                block["self_attn"][proj]["kernel"] *= 3.0
        assert rel_err(jax_logits(cfg, params), large) < 1e-4
        for block in params.blocks:
            block["self_attn"]["q_proj"]["kernel"][:, : cfg.head_dim] *= 3.0
        assert rel_err(jax_logits(cfg, params), large) > 1e-3
        return
    elif key == "gemma3":  # each of: the window, the local rope base, the global scaling, the cap
        for change in (
            dict(sliding_window=SEQ),
            dict(rope_local_theta=cfg.rope_theta),
            dict(rope_type="default"),
            dict(final_logit_softcap=0.0),
        ):
            assert rel_err(jax_logits(dataclasses.replace(cfg, **change), params), want) > 1e-3, change
        plain = dataclasses.replace(cfg, sliding_window_pattern=1)  # every layer global
    elif key == "granitemoe":  # each of the four scalars at its neutral value
        for change in (
            dict(embedding_multiplier=1.0),
            dict(residual_multiplier=1.0),
            dict(attention_multiplier=0.0),
        ):
            assert rel_err(jax_logits(dataclasses.replace(cfg, **change), params), want) > 1e-3, change
        plain = dataclasses.replace(cfg, logits_scaling=1.0)
    elif key == "gpt_oss":  # each of: the window, yarn, yarn's cos/sin factor alone; then the sinks
        for change in (dict(sliding_window=SEQ), dict(rope_type="default"), dict(rope_attention_factor=1.0)):
            assert rel_err(jax_logits(dataclasses.replace(cfg, **change), params), want) > 1e-3, change
        for block in params.blocks:
            block["self_attn"]["sinks"][...] = -1e9  # no weight on the sink: plain softmax attention
        plain = cfg
    else:
        plain = dataclasses.replace(cfg, rope_type="default")
    assert rel_err(jax_logits(plain, params), want) > 1e-3


def test_import_reads_the_text_model_of_gemma3_for_conditional_generation(tmp_path: Path) -> None:
    """Gemma 3 4B-27B are released as Gemma3ForConditionalGeneration: the text model's tensors under
    "language_model.", beside a vision tower. Import reads the text model, whose logits on text are
    the multimodal model's."""
    torch.manual_seed(3)
    c = GEMMA3
    text = transformers.Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=LAYERS,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        max_position_embeddings=SEQ,
        sliding_window=c.sliding_window,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=c.query_pre_attn_scalar,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )
    vision = transformers.SiglipVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    model = transformers.Gemma3ForConditionalGeneration(
        transformers.Gemma3Config(
            text_config=text,
            vision_config=vision,
            mm_tokens_per_image=4,
            image_token_index=VOCAB - 1,
            boi_token_index=VOCAB - 3,
            eoi_token_index=VOCAB - 2,
        )
    ).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "language_model" in name:
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "mm")
    with SafetensorsReader(tmp_path / "mm" / "model.safetensors") as r:
        assert any(k.startswith("vision_tower.") for k in r) and "language_model.model.norm.weight" in r
    tokens = np.where(TOKENS >= VOCAB - 3, 0, TOKENS)  # no image tokens
    with torch.no_grad():
        want = model(torch.from_numpy(tokens).long()).logits.float().numpy()
    cfg, params = import_hf(tmp_path / "mm")
    assert cfg.family == "gemma3" and cfg.sliding_window_pattern == 2 and cfg.head_dim == c.head_dim
    cfg = dataclasses.replace(cfg, compute_dtype="float32", attention_impl="xla")
    with jax.default_matmul_precision("highest"):
        got = np.asarray(forward(build_model(cfg), params, jnp.asarray(tokens)))
    assert rel_err(got, want) < 1e-4


AUX_COEF = 0.3  # large, so that the load-balancing loss's gradient moves the second step's loss


@pytest.mark.parametrize(
    "key",
    [
        "qwen3",
        "gemma3",
        "qwen3_moe",
        "mixtral",
        "gpt_oss",
        "phi3",
        "olmo2",
        "granitemoe",
        "granite",
        "qwen3_moe+aux",
        "mixtral+aux",
        "gpt_oss+aux",
        "granitemoe+aux",
    ],
)
def test_one_training_step_matches_transformers(key: str, hf_checkpoints: dict, tmp_path: Path) -> None:
    """An imported checkpoint's first step through the offload engine (blocks streamed, the update on
    the host): its loss is transformers' loss of the same batch, and after one plain SGD step of both
    the next step's loss is transformers' after its step, at float32 tolerance. For the MoE models
    both objectives are the cross-entropy alone (transformers' default, output_router_logits=false),
    and the SGD step moves routers and experts through the routing weights. "+aux": the checkpoint's
    config sets output_router_logits=true and a coefficient, which import reads: transformers' loss is
    then the cross-entropy plus the coefficient times its load-balancing loss, jaxzero's `loss` the
    cross-entropy and `aux_loss` the load-balancing loss, and the gradients (their norm, and the next
    step's loss) are of the sum."""
    path, _ = hf_checkpoints[key.removesuffix("+aux")]
    if key.endswith("+aux"):
        path = with_aux_loss(path, tmp_path)
    (losses, aux, norms), (want, want_aux, want_norms), cfg = two_steps_against_transformers(path, TOKENS)
    assert (aux[0] is None) == (cfg.num_experts == 0)
    if key.endswith("+aux"):
        np.testing.assert_allclose(aux, want_aux, rtol=1e-5)
        np.testing.assert_allclose(np.add(losses, AUX_COEF * np.array(aux)), want, rtol=1e-5)
        np.testing.assert_allclose(norms, want_norms, rtol=1e-4)
    else:
        np.testing.assert_allclose(losses, want, rtol=1e-5)
    assert abs(want[1] - want[0]) > 1e-3  # the step moved the loss: the second one compares updates


@pytest.mark.parametrize("key", ["qwen3_moe", "mixtral", "gpt_oss", "granitemoe"])
def test_a_padded_training_step_matches_transformers_with_its_attention_mask(
    key: str, hf_checkpoints: dict, tmp_path: Path
) -> None:
    """Rows of fine-tuning examples as jaxzero's data pads them (an example, its end-of-text, then
    padding; and an example cut to fill its row), their prompts not targets: transformers given the
    same ids, labels -100 where jaxzero counts no target and the attention mask zero at the padding
    leaves the padding out of its load-balancing loss, and so does jaxzero: the same aux, loss and
    gradients over two SGD steps. The prompts' tokens count in both (the mask keeps them)."""
    from jaxzero.config import padding_id
    from jaxzero.numerics.objective import real_tokens

    eot = 5
    window = np.where(TOKENS == eot, eot + 1, TOKENS)  # one end-of-text: the first example's
    window[0, 9], window[0, 10:] = eot, ~padding_id(eot)  # 10 tokens, then 6 of padding
    window[0, :4], window[1, :6] = ~window[0, :4], ~window[1, :6]  # the prompts: no targets
    assert not np.asarray(real_tokens(jnp.asarray(window), eot))[0, 10:].any()
    path = with_aux_loss(hf_checkpoints[key][0], tmp_path)
    (losses, aux, norms), (want, want_aux, want_norms), _ = two_steps_against_transformers(path, window, eot)
    np.testing.assert_allclose(aux, want_aux, rtol=1e-5)
    np.testing.assert_allclose(np.add(losses, AUX_COEF * np.array(aux)), want, rtol=1e-5)
    np.testing.assert_allclose(norms, want_norms, rtol=1e-4)
    # Counted, the padding gives transformers another loss: the comparison sees it.
    _, (_, every_aux, _), _ = two_steps_against_transformers(path, window, eot, transformers_mask=False)
    assert abs(every_aux[0] - aux[0]) > 1e-3 * aux[0]


def with_aux_loss(path: Path, tmp_path: Path) -> Path:
    """A copy of the checkpoint at `path` whose config turns the load-balancing loss on
    (output_router_logits, router_aux_loss_coef=AUX_COEF)."""
    shutil.copytree(path, tmp_path / "aux")
    config = json.loads((tmp_path / "aux" / "config.json").read_text())
    config.update(output_router_logits=True, router_aux_loss_coef=AUX_COEF)
    (tmp_path / "aux" / "config.json").write_text(json.dumps(config))
    return tmp_path / "aux"


def two_steps_against_transformers(
    path: Path, window: np.ndarray, eot: int = -2, transformers_mask: bool = True
) -> tuple[tuple[list, list, list], tuple[list, list, list], ModelConfig]:
    """Two plain SGD steps (lr 0.5) from the checkpoint at `path` on int32 window (2, SEQ) (`~id`: no
    target), by jaxzero's offload engine (`data.eot_id=eot`) and by transformers: ((losses, aux
    losses, gradient norms) of each, the imported config). transformers is given the ids, labels -100
    where jaxzero counts no target, and an attention mask zero at the rows' padding
    (`objective.real_tokens`; with `transformers_mask` false, at the last position only)."""
    from jaxzero.config import TrainConfig
    from jaxzero.numerics.objective import real_tokens
    from jaxzero.overrides import apply_overrides
    from jaxzero.plan import placement
    from jaxzero.trainer import build_trainer

    cfg, params = import_hf(path)
    assert cfg.router_aux_loss_coef == (AUX_COEF if path.name == "aux" else 0.0)
    cfg = dataclasses.replace(cfg, compute_dtype="float32", attention_impl="xla")
    lr = 0.5
    run = apply_overrides(
        dataclasses.replace(TrainConfig(), model=cfg),
        {
            "offload.optimizer": "cpu",
            "offload.params": "cpu",
            "data.seq_len": str(SEQ - 1),
            "data.batch_size": "2",
            "data.eot_id": str(eot),
            "optimizer.name": "sgd",
            "optimizer.momentum": "0",
            "optimizer.weight_decay": "0",
            "optimizer.grad_clip": "0",
            "optimizer.lr": str(lr),
            "optimizer.warmup_steps": "0",
            "optimizer.schedule": "constant",
        },
    )
    trainer = build_trainer(run, placement.make_mesh(jax.devices()[:1]))
    state = trainer.init_from_params(params)
    losses, aux, norms = [], [], []
    with jax.default_matmul_precision("highest"):
        for _ in range(2):
            state, m = trainer.step(state, trainer.put_batch(window[None]))
            losses.append(float(m.loss))
            norms.append(float(m.grad_norm))
            aux.append(None if m.aux_loss is None else float(m.aux_loss))

    model = load_torch(path, dtype=torch.float32)
    ids = torch.from_numpy(np.where(window < 0, ~window, window)).long()
    labels = torch.from_numpy(np.where(window < 0, -100, window)).long()
    # jaxzero's window of S+1 tokens runs its first S through the blocks; transformers runs all S+1,
    # the last one's logits unused. Its attention mask leaves that token out of the load-balancing
    # loss (nothing else reads it: the causal logits before it do not see it).
    mask = torch.ones_like(ids)
    if eot >= 0 and transformers_mask:
        mask[:, :-1] = torch.from_numpy(np.asarray(real_tokens(jnp.asarray(window), eot))).long()
    mask[:, -1] = 0
    want, want_aux, want_norms = [], [], []
    for _ in range(2):
        out = model(ids, labels=labels, attention_mask=mask)  # the mean over every target (+ coef x aux)
        loss = out.loss
        want.append(float(loss.detach()))
        want_aux.append(None if out.get("aux_loss") is None else float(out.aux_loss.detach()))
        model.zero_grad()
        loss.backward()
        want_norms.append(float(torch.sqrt(sum(torch.sum(p.grad**2) for p in model.parameters()))))
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
    return (losses, aux, norms), (want, want_aux, want_norms), cfg


def test_sliding_windows() -> None:
    """A window is kept from the checkpoint. Qwen2 uses its window only with use_sliding_window, and
    then only on the layers from max_window_layers on: a Qwen run longer than it is refused before
    anything runs; Mistral's, every layer's, is computed at any length. Mistral's null window means
    none."""
    mistral = hf_config(MISTRAL)
    assert model_config_from_hf({**mistral, "sliding_window": 4096}).sliding_window == 4096
    assert model_config_from_hf({**mistral, "sliding_window": None}).sliding_window == 0
    qwen2 = hf_config(QWEN2)
    assert (
        model_config_from_hf({**qwen2, "use_sliding_window": False, "sliding_window": 8}).sliding_window == 0
    )
    windowed_qwen = model_config_from_hf({**qwen2, "use_sliding_window": True, "sliding_window": 8})
    assert windowed_qwen.sliding_window == 8

    from jaxzero.config import TrainConfig
    from jaxzero.config.checks import validate

    def run(model: ModelConfig, seq_len: int) -> TrainConfig:
        data = dataclasses.replace(TrainConfig().data, seq_len=seq_len)
        return dataclasses.replace(TrainConfig(), model=dataclasses.replace(model, max_seq_len=64), data=data)

    validate(run(windowed_qwen, 8))
    with pytest.raises(
        ConfigError, match=r"data.seq_len=16 exceeds model.sliding_window=8 of a qwen2.*at most 8"
    ):
        validate(run(windowed_qwen, 16))
    validate(run(dataclasses.replace(MISTRAL, sliding_window=8), 16))


def test_an_import_reads_each_unit_when_the_trainer_places_it(jax_params: dict, tmp_path: Path) -> None:
    """`load_hf_by_unit` checks every name and shape from the headers at once, then reads a unit's
    tensors only when the offload trainer places it (one unit in host RAM at a time), in forward
    order; the state equals one made from the whole masters, bit for bit."""
    from jaxzero.config import TrainConfig
    from jaxzero.interop import hf_io, load_hf_by_unit
    from jaxzero.overrides import apply_overrides
    from jaxzero.plan import placement
    from jaxzero.trainer import build_trainer

    cfg, params = LLAMA, jax_params["llama"]
    export_hf(params, cfg, tmp_path / "ckpt", dtype="float32")
    opened: list[int] = []
    open_weights = hf_io._open_weights
    hf_io._open_weights = lambda ckpt: (opened.append(1), open_weights(ckpt))[1]
    try:
        lazy = load_hf_by_unit(cfg, tmp_path / "ckpt")
        assert len(opened) == 1  # the headers, checked; no unit read yet
        run = apply_overrides(
            dataclasses.replace(TrainConfig(), model=cfg),
            {
                "offload.optimizer": "cpu",
                "offload.params": "cpu",
                "data.seq_len": "8",
                "data.batch_size": "2",
            },
        )
        trainer = build_trainer(run, placement.make_mesh(jax.devices()[:1]))
        state = trainer.init_from_params(lazy)
        assert len(opened) == 1 + cfg.num_layers + 2  # then each unit, once
    finally:
        hf_io._open_weights = open_weights
    for a, b in zip(jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, np.asarray(b))


@pytest.mark.parametrize("key", ["mixtral", "qwen3_moe", "granitemoe"])
def test_a_moe_without_a_model_type_exports_under_the_type_it_implies(
    key: str, jax_params: dict, tmp_path: Path
) -> None:
    """A jaxzero-own mixture of experts (model.hf_model_type='') is written as the type its settings
    imply (q/k norms: Qwen3-MoE; Granite's scalars: Granite MoE; else Mixtral), config.json and the
    tensors' names alike: transformers loads every expert (no tensor missing or unexpected) to the
    same logits, and the import reads the type back."""
    cfg, params = dataclasses.replace(CONFIGS[key], hf_model_type=""), jax_params[key]
    export_hf(params, cfg, tmp_path / "f32", dtype="float32")
    assert json.loads((tmp_path / "f32" / "config.json").read_text())["model_type"] == key
    assert set(hf_tensor_names(cfg)) == set(hf_tensor_names(CONFIGS[key]))
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "f32", dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert rel_err(torch_logits(model), jax_logits(cfg, params)) < 1e-4
    assert import_hf(tmp_path / "f32")[0].hf_model_type == key

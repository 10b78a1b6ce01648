"""gpt-oss beyond the family matrix of tests/test_hf.py: the released sizes and configs, the MXFP4
experts of the released checkpoints (against transformers' own dequantisation), and what is refused."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from jaxzero.config import CheckpointError, ConfigError, ModelConfig
from jaxzero.interop import hf_config, import_hf, load_hf_into, model_config_from_hf
from jaxzero.interop.mxfp4 import dequantize
from jaxzero.interop.safetensors import load_file, save_file
from jaxzero.models import build_model, forward
from jaxzero.models.sizes import flops_per_token, matmul_param_count, param_count

# openai/gpt-oss-20b's config.json as released (transformers 4.55's spelling), less its token ids;
# gpt-oss-120b's differs in num_hidden_layers (36) and num_local_experts (128).
GPT_OSS_20B_JSON = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
    "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False,
    "quantization_config": {
        "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"
        ],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
        "rope_type": "yarn", "truncate": False,
    },
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088,
}  # fmt: skip
RELEASED = {
    "gpt-oss-20b": GPT_OSS_20B_JSON,
    "gpt-oss-120b": {
        **GPT_OSS_20B_JSON,
        "num_hidden_layers": 36,
        "num_local_experts": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 18,
    },
}
# The model card's totals and active parameters per token (OpenAI, "gpt-oss-120b & gpt-oss-20b Model
# Card", table 1: 116.83B / 5.13B and 20.91B / 3.61B), the formula's exact counts.
PUBLISHED = {
    "gpt-oss-20b": ("20.91B", "3.61B", 20_914_757_184),
    "gpt-oss-120b": ("116.83B", "5.13B", 116_829_156_672),
}


@pytest.mark.parametrize("name", list(RELEASED))
def test_sizes_are_the_released_configs(name: str) -> None:
    """The released config.json imports as the named size; its count is transformers' model's (built
    on the meta device), the formula's and the published total; its FLOPs count the top-4 experts."""
    cfg = ModelConfig.named(name)
    assert cfg.router_aux_loss_coef == RELEASED[name]["router_aux_loss_coef"] == 0.9
    # The released config turns the load-balancing loss off (output_router_logits), so import trains
    # without it, as transformers does; with it on, the coefficient is the named size's.
    assert model_config_from_hf(RELEASED[name], name=name) == dataclasses.replace(
        cfg, router_aux_loss_coef=0.0
    )
    assert model_config_from_hf({**RELEASED[name], "output_router_logits": True}, name=name) == cfg
    total, active, count = PUBLISHED[name]
    assert param_count(cfg) == count and f"{count / 1e9:.2f}B" == total
    hf = transformers.GptOssConfig(**{k: v for k, v in RELEASED[name].items() if k != "quantization_config"})
    with torch.device("meta"):
        model = transformers.GptOssForCausalLM(hf)
    assert sum(p.numel() for p in model.parameters()) == count
    # Active, as the model card counts it: less the experts outside the top 4 (their kernels and
    # biases) in every layer, and less the embedding table (a lookup; the unembedding counts).
    d, f, e, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok
    active_count = count - cfg.num_layers * (e - k) * (3 * d * f + 2 * f + d) - cfg.vocab_size * d
    assert f"{active_count / 1e9:.2f}B" == active
    # FLOPs: 6 per multiplied weight: biases, norms (two per layer, the final one) and sinks none.
    biases = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim + d + e + k * (2 * f + d)
    matmul = active_count - d - cfg.num_layers * (2 * d + cfg.num_heads + biases)
    assert matmul_param_count(cfg) == matmul
    # Attention: the global half of the layers over the sequence, the local half over their 128 keys.
    half = cfg.num_layers // 2
    attention = 12 * cfg.num_heads * cfg.head_dim * (half * 4096 + half * 128)
    assert flops_per_token(cfg, 4096) == 6 * matmul + attention


def test_mxfp4_dequantisation_is_transformers(tmp_path: Path) -> None:
    """Random packed experts (every code, scales 2^-10 .. 2^10) decode to transformers'
    `convert_moe_packed_tensors` values exactly, in float32 and rounded to its bfloat16 default."""
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 10, 4, 16), dtype=np.uint8)
    scales = rng.integers(117, 138, (3, 10, 4), dtype=np.uint8)
    got = dequantize(blocks, scales)
    assert got.shape == (3, 4 * 32, 10) and got.dtype == np.float32
    b, s = torch.from_numpy(blocks), torch.from_numpy(scales)
    want = convert_moe_packed_tensors(b, s, dtype=torch.float32).numpy()
    np.testing.assert_array_equal(got, want)
    bf16 = convert_moe_packed_tensors(b, s).float().numpy()  # transformers' default dtype
    np.testing.assert_array_equal(got, bf16)


D, F, E, VOCAB, SEQ = 64, 32, 4, 96, 12  # MXFP4 groups 32 values: D and F multiples of 32


def _tiny_hf(path: Path) -> tuple[transformers.GptOssForCausalLM, dict[str, np.ndarray]]:
    """A random transformers gpt-oss saved at `path` with its experts stored packed, as released:
    returns the model holding the dequantised experts, and the packed tensors written."""
    torch.manual_seed(0)
    config = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=D, intermediate_size=F, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=E, num_experts_per_tok=2, sliding_window=4,
        max_position_embeddings=64, pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    model = transformers.GptOssForCausalLM(config).eval()
    model.save_pretrained(path)
    rng = np.random.default_rng(1)
    tensors = {k: np.array(v) for k, v in load_file(path / "model.safetensors").items()}
    packed = {}
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
        e, c, r = tensors.pop(name).shape
        blocks = rng.integers(0, 256, (e, r, c // 32, 16), dtype=np.uint8)
        scales = rng.integers(120, 124, (e, r, c // 32), dtype=np.uint8)  # values up to 6 / 8
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
        value = convert_moe_packed_tensors(
            torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32
        )
        with torch.no_grad():
            model.get_parameter(name).copy_(value)
    save_file({**tensors, **packed}, path / "model.safetensors", metadata={"format": "pt"})
    d = json.loads((path / "config.json").read_text())
    d["quantization_config"] = GPT_OSS_20B_JSON["quantization_config"]
    (path / "config.json").write_text(json.dumps(d))
    return model, packed


def test_an_mxfp4_checkpoint_imports_to_transformers_logits(tmp_path: Path) -> None:
    """Its experts are dequantised at import (one expert at a time) into the (E, D, 2F) / (E, F, D)
    float32 masters; the logits are those of transformers' model holding the dequantised values. A
    pair that does not fit (a scales tensor of the wrong shape) is refused before any data is read."""
    model, packed = _tiny_hf(tmp_path / "ckpt")
    cfg, params = import_hf(tmp_path / "ckpt")
    assert cfg.family == "gpt_oss" and params.blocks[0]["mlp"]["gate_up"]["kernel"].shape == (E, D, 2 * F)
    tokens = np.random.default_rng(2).integers(0, VOCAB, (2, SEQ))
    with torch.no_grad():
        want = model(torch.from_numpy(tokens)).logits.numpy()
    cfg = dataclasses.replace(cfg, compute_dtype="float32", attention_impl="xla")
    with jax.default_matmul_precision("highest"):
        got = np.asarray(forward(build_model(cfg), params, jnp.asarray(tokens, jnp.int32)))
    assert np.max(np.abs(got - want)) / np.max(np.abs(want)) < 1e-4

    # A run's config must be the checkpoint's in what the weights compute (the clamp, the window, yarn).
    wrong = dataclasses.replace(cfg, swiglu_limit=5.0, sliding_window=8, rope_beta_fast=16.0)
    with pytest.raises(ConfigError) as e:
        load_hf_into(wrong, tmp_path / "ckpt")
    for field, ours, theirs in [
        ("swiglu_limit", 5.0, 7.0),
        ("sliding_window", 8, 4),
        ("rope_beta_fast", 16.0, 32.0),
    ]:
        assert f"model.{field}: run config has {ours!r}, checkpoint has {theirs!r}" in str(e.value)

    name = "model.layers.1.mlp.experts.down_proj_scales"
    tensors = {k: np.array(v) for k, v in load_file(tmp_path / "ckpt" / "model.safetensors").items()}
    tensors[name] = tensors[name][:, :, :0]
    save_file(tensors, tmp_path / "ckpt" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        CheckpointError, match=rf"{name}: checkpoint U8 \[4, 64, 0\], MXFP4 .* needs U8 \[4, 64, 1\]"
    ):
        import_hf(tmp_path / "ckpt")


def test_what_gpt_oss_cannot_compute_is_refused() -> None:
    """Another quantisation, irregular layer kinds, another rope; yarn outside gpt-oss."""
    d = hf_config(ModelConfig.named("gpt-oss-20b", num_layers=4))
    for edit, match in [
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config=.*MXFP4 only"),
        ({"layer_types": ["sliding_attention"] * 3 + ["full_attention"] * 1 + []}, None),
        ({"layer_types": ["full_attention", "sliding_attention"] * 2}, r"layer_types=.*every N-th"),
        (
            {"rope_parameters": {"rope_type": "llama3", "factor": 8.0}, "rope_scaling": None},
            "rope type 'llama3'",
        ),
        ({"attention_dropout": 0.1}, "attention_dropout=0.1"),
    ]:
        if match is None:  # every 4th layer global: a period, computed
            assert model_config_from_hf({**d, **edit}).sliding_window_pattern == 4
            continue
        with pytest.raises(ConfigError, match=match):
            model_config_from_hf({**d, **edit})
    with pytest.raises(ConfigError, match="model.rope_type=yarn scales cos and sin as gpt-oss does"):
        build_model(ModelConfig(rope_type="yarn", rope_factor=4.0))
    with pytest.raises(ConfigError, match=r"model.family=gpt_oss needs model.num_experts >= 1"):
        build_model(ModelConfig(family="gpt_oss", sliding_window_pattern=2, moe_intermediate_size=8))


def test_an_mxfp4_checkpoint_fine_tunes_and_exports_the_users_way(tmp_path: Path) -> None:
    """`python -m jaxzero.train --model.name=hf:DIR` over the released form (MXFP4 experts), streamed
    under ZeRO-3 offload, then `python -m jaxzero.export`: transformers loads the export as
    GptOssForCausalLM (experts in bfloat16) with jaxzero's logits of the trained weights, which moved."""
    from jaxzero.cli import export as export_lib
    from jaxzero.cli import train as train_lib

    _tiny_hf(tmp_path / "ckpt")
    run = tmp_path / "run"
    argv = [f"--model.name=hf:{tmp_path / 'ckpt'}", "--model.compute_dtype=float32", "--steps=2"]
    argv += ["--data.source=synthetic", "--data.seq_len=12", "--data.batch_size=4", "--optimizer.lr=1e-2"]
    argv += ["--offload.params=cpu", "--offload.optimizer=cpu", f"--run_dir={run}", "--logging.eval_every=0"]
    assert train_lib.main(argv) == 0
    assert export_lib.main([f"--run_dir={run}", f"--out={tmp_path / 'hf'}", "--dtype=float32"]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(model).__name__ == "GptOssForCausalLM"
    cfg, trained = import_hf(tmp_path / "hf")
    _, start = import_hf(tmp_path / "ckpt")
    assert not np.allclose(
        trained.blocks[0]["mlp"]["gate_up"]["kernel"], start.blocks[0]["mlp"]["gate_up"]["kernel"]
    )
    tokens = np.random.default_rng(3).integers(0, VOCAB, (2, SEQ))
    with torch.no_grad():
        want = model(torch.from_numpy(tokens)).logits.numpy()
    cfg = dataclasses.replace(cfg, compute_dtype="float32", attention_impl="xla")
    with jax.default_matmul_precision("highest"):
        got = np.asarray(forward(build_model(cfg), trained, jnp.asarray(tokens, jnp.int32)))
    assert np.max(np.abs(got - want)) / np.max(np.abs(want)) < 1e-4

"""PEFT interop against the real library: jaxzero's LoRA adapters exported in PEFT's format load with
`peft.PeftModel.from_pretrained` and compute the same logits and gradients; PEFT's own files import back.

For each of the Llama, Qwen2 (q/k/v biases, tied head), Mistral, ... families a tiny random transformers
model (hidden 32, 2 layers, vocab 100) is saved and imported with `import_hf`, and random adapters with a
nonzero lora_b (PEFT initialises it to zero, which would make a missing or misread adapter invisible)
are put on a few projections. Compute is float32 on both sides.
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import safetensors.numpy
import torch
import transformers

from jaxzero.config import CheckpointError, ConfigError, FinetuneConfig, ModelConfig, TrainConfig
from jaxzero.finetune.adapters import TARGET_PATHS, init_adapters, lora_spec
from jaxzero.finetune.merged import merged_params
from jaxzero.interop import export_hf, import_hf, load_hf_by_unit
from jaxzero.interop.peft import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    export_peft_adapter,
    import_peft_adapter,
)
from jaxzero.interop.safetensors import load_file, save_file
from jaxzero.models import Llama, Model, ModelParams, build_model, forward
from jaxzero.models.lora import merge_trees, quantize_kernel
from jaxzero.primitives.deferred import is_deferred, resolved
from jaxzero.storage.export_dir import ExportRefused

VOCAB, HIDDEN, LAYERS, SEQ = 100, 32, 2, 12
TOKENS = np.random.default_rng(0).integers(0, VOCAB, size=(2, SEQ), dtype=np.int32)
# Logits are O(1) (weights ~ N(0, 0.1)); float32 forwards of this size agree to ~1e-6, so 1e-4 leaves a
# wide margin while anything misread (a transposed matrix, a wrong scale, a dropped adapter) moves the
# logits by ~1e-1 (asserted: the adapters change them by far more than the tolerance).
LOGIT_ATOL = 1e-4

# Per family: the transformers config's extras, and adapters on a few targets (a non-integer alpha / r
# for Qwen2, every projection for Mistral and Qwen3).
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(
        hf={}, ft=FinetuneConfig(method="lora", lora_rank=4, lora_alpha=8, lora_targets="q,v,down")
    ),
    "qwen2": dict(hf={}, ft=FinetuneConfig(method="lora", lora_rank=2, lora_alpha=3, lora_targets="q,k,v,o")),
    "mistral": dict(
        hf={"sliding_window": SEQ},
        ft=FinetuneConfig(method="lora", lora_rank=4, lora_alpha=16, lora_targets="q,k,v,o,gate,up,down"),
    ),
    # Gemma 3: layer 0 local (window 4 of 12 positions), layer 1 global; sandwich norms, GeGLU.
    "gemma3": dict(
        hf={
            "head_dim": 16,
            "sliding_window": 4,
            "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 12,
            "pad_token_id": None,
        },
        ft=FinetuneConfig(method="lora", lora_rank=4, lora_alpha=8, lora_targets="q,k,v,o,gate,up,down"),
    ),
    # Qwen3: q/k norms, heads twice as wide as hidden_size / num_heads; every projection.
    "qwen3": dict(
        hf={"head_dim": 16},
        ft=FinetuneConfig(method="lora", lora_rank=4, lora_alpha=8, lora_targets="q,k,v,o,gate,up,down"),
    ),
    # Phi-3: PEFT's targets are its fused modules (qkv_proj, gate_up_proj), as jaxzero's; rope over half
    # of each head. OLMo 2: norms after each sub-block, q/k norms over the projections; every projection.
    "phi3": dict(
        hf={"pad_token_id": None, "rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}},
        ft=FinetuneConfig(method="lora", lora_rank=4, lora_alpha=8, lora_targets="qkv,o,gate_up,down"),
    ),
    "olmo2": dict(
        hf={"pad_token_id": None},
        ft=FinetuneConfig(method="lora", lora_rank=4, lora_alpha=8, lora_targets="q,k,v,o,gate,up,down"),
    ),
    # Qwen3-MoE: Qwen3's attention adapted, its 4 experts (top 2) and routers frozen.
    "qwen3_moe": dict(
        hf={"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
            "norm_topk_prob": True},  # fmt: skip
        ft=FinetuneConfig(method="lora", lora_rank=4, lora_alpha=8, lora_targets="q,k,v,o"),
    ),
    # gpt-oss: attention biased on q, k, v and o, with sinks, layer 0 local (window 4), yarn rope; its
    # 4 biased experts (top 2) and routers frozen.
    "gpt_oss": dict(
        hf={"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4,
            "layer_types": ["sliding_attention", "full_attention"], "pad_token_id": None},  # fmt: skip
        ft=FinetuneConfig(method="lora", lora_rank=4, lora_alpha=8, lora_targets="q,k,v,o"),
    ),
    # Granite MoE: tied, the four scalars (scores times 1/8 where 1/sqrt(head_dim) is 1/4); its 4 fused
    # experts (top 2) and routers frozen.
    "granitemoe": dict(
        hf={"num_local_experts": 4, "num_experts_per_tok": 2, "embedding_multiplier": 12.0,
            "residual_multiplier": 0.22, "attention_multiplier": 0.125, "logits_scaling": 2.0},  # fmt: skip
        ft=FinetuneConfig(method="lora", lora_rank=4, lora_alpha=8, lora_targets="q,k,v,o"),
    ),
    # Granite (dense): the same scalars over Llama's block; every projection.
    "granite": dict(
        hf={"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.125,
            "logits_scaling": 2.0},  # fmt: skip
        ft=FinetuneConfig(method="lora", lora_rank=4, lora_alpha=8, lora_targets="q,k,v,o,gate,up,down"),
    ),
}


def torch_model(family: str) -> torch.nn.Module:
    """A random transformers model of `family`, every parameter random (norm weights ~ 1 + N(0, 0.1),
    q/k/v biases ~ N(0, 0.1), so that one read from the wrong tensor could not go unnoticed)."""
    torch.manual_seed(zlib.crc32(family.encode()))
    common = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=48,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        max_position_embeddings=SEQ,
        rms_norm_eps=1e-6,
        initializer_range=0.1,
        tie_word_embeddings=family in ("qwen2", "gemma3", "granitemoe", "granite"),
        bos_token_id=None,
        eos_token_id=None,
        **FAMILIES[family]["hf"],
    )
    classes = {
        "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
        "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config),
        "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig),
        "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config),
        "qwen3_moe": (transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig),
        "gemma3": (transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig),
        "gpt_oss": (transformers.GptOssForCausalLM, transformers.GptOssConfig),
        "phi3": (transformers.Phi3ForCausalLM, transformers.Phi3Config),
        "olmo2": (transformers.Olmo2ForCausalLM, transformers.Olmo2Config),
        "granitemoe": (transformers.GraniteMoeForCausalLM, transformers.GraniteMoeConfig),
        "granite": (transformers.GraniteForCausalLM, transformers.GraniteConfig),
    }
    model_cls, config_cls = classes[family]
    model = model_cls(config_cls(**common))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(p))
    return model.eval()


def load_torch(path: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def torch_logits(model: torch.nn.Module) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(TOKENS).long()).logits.float().numpy()


def random_adapters(cfg: ModelConfig, ft: FinetuneConfig, seed: int) -> ModelParams:
    """Adapters of `ft`'s shapes with lora_a ~ N(0, 1/in) and lora_b ~ N(0, 0.25/r), both nonzero: each
    adapter's product is of the size of its base projection's output."""
    shapes = init_adapters(jax.random.key(seed), build_model(cfg), ft)
    rng = np.random.default_rng(seed)

    def draw(path: tuple[Any, ...], x: jax.Array) -> np.ndarray:
        if jax.tree_util.keystr(path).endswith("['lora_a']"):
            return (rng.standard_normal(x.shape) / np.sqrt(x.shape[0])).astype(np.float32)
        return (0.5 * rng.standard_normal(x.shape) / np.sqrt(x.shape[0])).astype(np.float32)

    return jax.tree_util.tree_map_with_path(draw, shapes)


def with_adapters(base: ModelParams, adapters: ModelParams) -> ModelParams:
    """The base's blocks with their adapters beside the kernels (what a LoRA `Llama` reads)."""
    return ModelParams(
        base.embed, tuple(merge_trees(b, a) for b, a in zip(base.blocks, adapters.blocks)), base.head
    )


def jax_logits(model: Model, params: ModelParams) -> np.ndarray:
    """(2, SEQ, VOCAB) float32 logits of jaxzero's forward, full-precision matmuls."""
    with jax.default_matmul_precision("highest"):
        return np.asarray(forward(model, params, jnp.asarray(TOKENS)))


def max_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


@dataclasses.dataclass
class Case:
    """One family's base (saved by transformers, imported into jaxzero), adapters and their export."""

    family: str
    hf_dir: Path
    cfg: ModelConfig
    base: ModelParams
    ft: FinetuneConfig
    adapters: ModelParams
    adapter_dir: Path

    def peft_model(self, trainable: bool = False) -> peft.PeftModel:
        """PEFT's model of the exported adapter over a fresh copy of the base."""
        return peft.PeftModel.from_pretrained(
            load_torch(self.hf_dir), self.adapter_dir, is_trainable=trainable
        ).eval()

    def lora_model(self) -> Model:
        return dataclasses.replace(build_model(self.cfg), lora=lora_spec(self.ft))


@pytest.fixture(scope="module", params=list(FAMILIES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    family = request.param
    hf_dir = tmp_path_factory.mktemp(f"hf-{family}")
    torch_model(family).save_pretrained(hf_dir)
    cfg, base = import_hf(hf_dir)
    cfg = dataclasses.replace(cfg, compute_dtype="float32", attention_impl="xla")
    ft = FAMILIES[family]["ft"]
    adapters = random_adapters(cfg, ft, seed=zlib.crc32(family.encode()))
    adapter_dir = tmp_path_factory.mktemp(f"adapter-{family}") / "out"
    export_peft_adapter(adapters, cfg, ft, adapter_dir, base_model_name_or_path=str(hf_dir))
    return Case(family, hf_dir, cfg, base, ft, adapters, adapter_dir)


# -------------------------------------------------------------------------------------------------
# The exported adapter in PEFT
# -------------------------------------------------------------------------------------------------


def test_exported_adapter_gives_peft_the_same_logits(case: Case) -> None:
    ours = jax_logits(case.lora_model(), with_adapters(case.base, case.adapters))
    theirs = torch_logits(case.peft_model())
    base = torch_logits(load_torch(case.hf_dir))
    assert max_diff(ours, theirs) <= LOGIT_ATOL
    # The adapters matter: a dropped or misread one would be seen.
    assert max_diff(theirs, base) > 1000 * LOGIT_ATOL


def test_export_is_what_peft_itself_saves(case: Case, tmp_path: Path) -> None:
    """PEFT's save_pretrained of the loaded adapter writes our keys, shapes and values, and the
    config fields we write; and its files import back to our arrays, bitwise."""
    case.peft_model().save_pretrained(tmp_path / "resaved")
    ours = safetensors.numpy.load_file(case.adapter_dir / ADAPTER_WEIGHTS_NAME)
    theirs = safetensors.numpy.load_file(tmp_path / "resaved" / ADAPTER_WEIGHTS_NAME)
    assert sorted(ours) == sorted(theirs)
    for name in ours:
        assert ours[name].dtype == theirs[name].dtype == np.float32
        assert np.array_equal(ours[name], theirs[name]), name
    mine = json.loads((case.adapter_dir / ADAPTER_CONFIG_NAME).read_text())
    peft_cfg = json.loads((tmp_path / "resaved" / ADAPTER_CONFIG_NAME).read_text())
    for field in mine:
        if field == "target_modules":  # PEFT writes a set's order
            assert sorted(mine[field]) == sorted(peft_cfg[field])
        else:
            assert mine[field] == peft_cfg[field], field
    assert mine["r"] == case.ft.lora_rank and mine["lora_alpha"] == case.ft.lora_alpha
    assert sorted(mine["target_modules"]) == sorted(TARGET_PATHS[t][1] for t in case.ft.targets)
    settings, back = import_peft_adapter(tmp_path / "resaved", case.cfg)
    assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(a, b), back, jax.device_get(case.adapters)))


def test_adapter_gradients_match_peft(case: Case) -> None:
    """jax.grad of the mean next-token cross entropy with respect to the adapters (base fixed) equals
    torch autograd's through PEFT's model, lora_A.grad (r, in) / lora_B.grad (out, r) transposed.

    Tolerance: 1e-4 of the largest gradient entry. Both sides are float32 over the same ~20 matmuls of
    at most 48-term sums, whose rounding differences stay ~1e-6 relative; any real difference (a
    transposed factor, a wrong scale, a missed term such as the adapter's path through a bias) is O(1)
    relative."""
    model = case.lora_model()
    tokens = jnp.asarray(TOKENS)

    def loss(adapters: ModelParams) -> jax.Array:
        logits = forward(model, with_adapters(case.base, adapters), tokens)
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

    with jax.default_matmul_precision("highest"):
        jax_loss, grads = jax.value_and_grad(loss)(jax.tree.map(jnp.asarray, case.adapters))

    pm = case.peft_model(trainable=True)
    t = torch.from_numpy(TOKENS).long()
    logits = pm(t).logits
    torch_loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), t[:, 1:].reshape(-1))
    torch_loss.backward()
    assert abs(float(jax_loss) - torch_loss.item()) <= 1e-5

    theirs: dict[tuple[int, str, str, str], np.ndarray] = {}
    for name, p in pm.named_parameters():
        if ".lora_" in name:
            assert p.grad is not None, name
            parts = name.split(".")
            i = parts.index("layers")
            key = "lora_a" if parts[i + 4] == "lora_A" else "lora_b"
            theirs[(int(parts[i + 1]), parts[i + 2], parts[i + 3], key)] = p.grad.numpy().T
    ours = {
        (i, group, proj, key): np.asarray(g)
        for i, block in enumerate(grads.blocks)
        for group, projs in block.items()
        for proj, pair in projs.items()
        for key, g in pair.items()
    }
    assert sorted(ours) == sorted(theirs)
    assert len(ours) == 2 * LAYERS * len(case.ft.targets)
    peak = max(float(np.max(np.abs(g))) for g in theirs.values())
    for k in ours:
        assert np.max(np.abs(theirs[k])) > 0, k  # every adapter is in the loss
        assert max_diff(ours[k], theirs[k]) <= 1e-4 * peak, k


# -------------------------------------------------------------------------------------------------
# Import
# -------------------------------------------------------------------------------------------------


def test_round_trip_is_bitwise(case: Case) -> None:
    settings, back = import_peft_adapter(case.adapter_dir, case.cfg)
    assert (settings.lora_rank, settings.lora_alpha, settings.lora_dropout, settings.targets) == (
        case.ft.lora_rank,
        case.ft.lora_alpha,
        case.ft.lora_dropout,
        case.ft.targets,
    )
    assert settings.method == "lora"
    assert back.embed == {} and back.head == {}
    want = jax.device_get(case.adapters)
    assert jax.tree.structure(back) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(want)):
        assert a.dtype == np.float32 and a.shape == b.shape and np.array_equal(a, b)
    # A run's settings that agree come back as given (its dropout and base storage are its own).
    run = dataclasses.replace(case.ft, lora_dropout=0.1, base_dtype="int8")
    assert import_peft_adapter(case.adapter_dir, case.cfg, run)[0] is run


def test_import_names_what_does_not_match(tmp_path: Path) -> None:
    cfg, ft = llama_cfg(), FAMILIES["llama"]["ft"]
    adapters = random_adapters(cfg, ft, seed=3)
    out = export_peft_adapter(adapters, cfg, ft, tmp_path / "a")

    run = dataclasses.replace(ft, lora_rank=8, lora_alpha=16, lora_targets="q,k,v")
    with pytest.raises(ConfigError) as e:
        import_peft_adapter(out, cfg, run)
    msg = str(e.value)
    assert "finetune.lora_rank: run has 8, adapter has 4" in msg
    assert "finetune.lora_alpha: run has 16.0, adapter has 8.0" in msg
    assert "finetune.lora_targets: run has 'q,k,v', adapter has 'q,v,down'" in msg

    wider = dataclasses.replace(cfg, hidden_size=64)
    with pytest.raises(
        CheckpointError,
        match=r"layers\.0\.self_attn\.q_proj\.lora_A\.weight: stored \[4, 32\], needed \[4, 64\]",
    ):
        import_peft_adapter(out, wider)
    with pytest.raises(CheckpointError, match=r"adapters on layers \[0, 1\], but model .* has 3 layers"):
        import_peft_adapter(out, dataclasses.replace(cfg, num_layers=3))

    def edited(name: str, config_edit: dict[str, Any], tensors_edit: Any = None) -> Path:
        d = tmp_path / name
        d.mkdir()
        config = json.loads((out / ADAPTER_CONFIG_NAME).read_text()) | config_edit
        (d / ADAPTER_CONFIG_NAME).write_text(json.dumps(config))
        tensors = {k: np.array(v) for k, v in load_file(out / ADAPTER_WEIGHTS_NAME).items()}
        save_file(
            tensors_edit(tensors) if tensors_edit else tensors, d / ADAPTER_WEIGHTS_NAME, {"format": "pt"}
        )
        return d

    with pytest.raises(CheckpointError, match=r"use_dora=True .*\n  use_rslora=True"):
        import_peft_adapter(edited("dora", {"use_dora": True, "use_rslora": True}), cfg)
    with pytest.raises(CheckpointError, match=r"target_modules names \['lm_head'\]"):
        import_peft_adapter(
            edited("head", {"target_modules": ["q_proj", "v_proj", "down_proj", "lm_head"]}), cfg
        )
    with pytest.raises(CheckpointError, match=r"target_modules \['q_proj'\] disagree with the saved tensors"):
        import_peft_adapter(edited("fewer", {"target_modules": ["q_proj"]}), cfg)

    def one_layer(t: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {k: v for k, v in t.items() if ".layers.1." not in k}

    with pytest.raises(CheckpointError, match=r"adapters on layers \[0\]"):
        import_peft_adapter(edited("one-layer", {"layers_to_transform": [0]}, one_layer), cfg)
    # A pattern for target_modules: the saved tensors say what it matched.
    settings, back = import_peft_adapter(edited("pattern", {"target_modules": ".*(q|v|down)_proj"}), cfg)
    assert settings.targets == ft.targets
    with pytest.raises(CheckpointError, match="holds no adapter_config.json"):
        import_peft_adapter(tmp_path, cfg)


# -------------------------------------------------------------------------------------------------
# Merge
# -------------------------------------------------------------------------------------------------


def test_merged_params_and_their_export(case: Case, tmp_path: Path) -> None:
    merged = merged_params(case.base, case.adapters, case.ft)
    scale = case.ft.lora_alpha / case.ft.lora_rank
    adapted = {TARGET_PATHS[t] for t in case.ft.targets}
    for base_block, pairs, block in zip(case.base.blocks, case.adapters.blocks, merged.blocks):
        for group in ("self_attn", "mlp"):
            for proj, params in base_block[group].items():
                got = block[group][proj]
                if not isinstance(params, dict):  # gpt-oss's sinks: a leaf of the attention itself
                    assert got is params
                    continue
                assert sorted(got) == sorted(params)  # the same leaves: biases kept, nothing added
                if (group, proj) in adapted:
                    pair = pairs[group][proj]
                    want = np.float64(params["kernel"]) + scale * (
                        np.float64(pair["lora_a"]) @ np.float64(pair["lora_b"])
                    )
                    assert got["kernel"].dtype == np.float32
                    # float32 rounding of an O(1) sum of r + 1 terms
                    assert max_diff(got["kernel"], want) <= 1e-6 * np.max(np.abs(want))
                else:  # an unadapted projection's kernel and bias, or a q/k norm's scale (Qwen3)
                    assert all(got[leaf] is params[leaf] for leaf in params)
    # The merged plain model computes the adapted one.
    adapted_logits = jax_logits(case.lora_model(), with_adapters(case.base, case.adapters))
    merged_logits = jax_logits(build_model(case.cfg), merged)
    assert max_diff(merged_logits, adapted_logits) <= LOGIT_ATOL
    # PEFT's merge_and_unload, and our merged export read by transformers, give the same logits.
    peft_merged = torch_logits(case.peft_model().merge_and_unload())
    assert max_diff(merged_logits, peft_merged) <= LOGIT_ATOL
    export_hf(merged, case.cfg, tmp_path / "merged", dtype="float32")
    assert max_diff(torch_logits(load_torch(tmp_path / "merged")), peft_merged) <= LOGIT_ATOL


def test_merge_of_an_int8_base(case: Case) -> None:
    """int8 kernels are dequantised in float32 before the adapter is added, and lose their scale: the
    merged plain model computes what the adapted int8 one does."""

    def quantize(block: Any) -> Any:
        if isinstance(block, dict) and "kernel" in block:
            q, s = quantize_kernel(block["kernel"])
            return {**block, "kernel": q, "kernel_scale": s}
        return {k: quantize(v) for k, v in block.items()} if isinstance(block, dict) else block

    base = ModelParams(case.base.embed, tuple(quantize(b) for b in case.base.blocks), case.base.head)
    merged = merged_params(base, case.adapters, case.ft)
    scale = case.ft.lora_alpha / case.ft.lora_rank
    for qblock, pairs, block in zip(base.blocks, case.adapters.blocks, merged.blocks):
        for group, proj in TARGET_PATHS.values():
            if proj not in qblock[group] and not (group == "mlp" and case.cfg.num_experts):
                continue  # the other layout's projection (Phi-3's fused ones, or the separate ones)
            if proj not in qblock[group]:  # a mixture of experts' MLP: its kernels are stacks
                for name, q in qblock[group].items():
                    got = block[group][name]
                    assert "kernel_scale" not in got and got["kernel"].dtype == np.float32
                    want = np.float64(q["kernel"]) * np.float64(q["kernel_scale"])[..., None, :]
                    assert max_diff(got["kernel"], want) <= 1e-6 * np.max(np.abs(want))
                continue
            q = qblock[group][proj]
            got = block[group][proj]
            assert "kernel_scale" not in got and got["kernel"].dtype == np.float32
            want = np.float64(q["kernel"]) * np.float64(q["kernel_scale"])[None, :]
            if proj in pairs.get(group, {}):
                pair = pairs[group][proj]
                want = want + scale * (np.float64(pair["lora_a"]) @ np.float64(pair["lora_b"]))
            assert max_diff(got["kernel"], want) <= 1e-6 * np.max(np.abs(want))
    adapted_logits = jax_logits(case.lora_model(), with_adapters(base, case.adapters))
    assert max_diff(jax_logits(build_model(case.cfg), merged), adapted_logits) <= LOGIT_ATOL


def test_merge_of_a_deferred_base_is_deferred(case: Case) -> None:
    """A base read unit by unit (`load_hf_by_unit`) merges unit by unit, to the same arrays."""
    lazy = merged_params(load_hf_by_unit(case.cfg, case.hf_dir), case.adapters, case.ft)
    assert all(is_deferred(b) for b in lazy.blocks)
    eager = merged_params(case.base, case.adapters, case.ft)
    got = resolved(lazy)
    assert jax.tree.structure(got) == jax.tree.structure(eager)
    assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(a, b), got, eager))
    shapes = jax.tree.map(lambda x: (x.shape, x.dtype), [b.shapes for b in lazy.blocks])
    assert shapes == jax.tree.map(lambda x: (x.shape, x.dtype), list(eager.blocks))


# -------------------------------------------------------------------------------------------------
# The output directory
# -------------------------------------------------------------------------------------------------


def llama_cfg() -> ModelConfig:
    return ModelConfig(
        name="peft-test",
        family="llama",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_layers=LAYERS,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=48,
        max_seq_len=SEQ,
        tie_embeddings=False,
        compute_dtype="float32",
        attention_impl="xla",
    )


def test_export_refuses_a_directory_holding_other_files(tmp_path: Path) -> None:
    cfg, ft = llama_cfg(), FAMILIES["llama"]["ft"]
    adapters = random_adapters(cfg, ft, seed=1)
    foreign = tmp_path / "user"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ExportRefused, match=r"is not empty and is not a jaxzero export \(it holds notes.txt"):
        export_peft_adapter(adapters, cfg, ft, foreign)
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]
    assert (foreign / "notes.txt").read_text() == "mine"

    out = export_peft_adapter(adapters, cfg, ft, tmp_path / "new" / "adapter")
    assert sorted(p.name for p in out.iterdir()) == [
        ".jaxzero-export",
        ADAPTER_CONFIG_NAME,
        ADAPTER_WEIGHTS_NAME,
    ]
    with pytest.raises(ExportRefused, match="pass overwrite=True"):
        export_peft_adapter(adapters, cfg, ft, out)
    other = random_adapters(cfg, ft, seed=2)
    export_peft_adapter(other, cfg, ft, out, overwrite=True)
    back = import_peft_adapter(out, cfg)[1]
    assert np.array_equal(
        back.blocks[1]["mlp"]["down_proj"]["lora_b"], other.blocks[1]["mlp"]["down_proj"]["lora_b"]
    )


def test_export_names_adapters_that_do_not_match(tmp_path: Path) -> None:
    cfg, ft = llama_cfg(), FAMILIES["llama"]["ft"]
    adapters = random_adapters(cfg, ft, seed=1)
    block = {**adapters.blocks[1], "mlp": {}}
    bad = ModelParams({}, (adapters.blocks[0], block), {})
    with pytest.raises(ValueError, match=r"block 1: missing mlp/down_proj/lora_a \(48, 4\)"):
        export_peft_adapter(bad, cfg, ft, tmp_path / "a")
    with pytest.raises(
        ValueError, match=r"block 0: self_attn/q_proj/lora_a has shape \(32, 4\), expected \(32, 8\)"
    ):
        export_peft_adapter(adapters, cfg, dataclasses.replace(ft, lora_rank=8), tmp_path / "b")
    with pytest.raises(ValueError, match="adapters have 2 blocks but model 'peft-test' has num_layers=3"):
        export_peft_adapter(adapters, dataclasses.replace(cfg, num_layers=3), ft, tmp_path / "c")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def lora_run_over_hf(tmp_path: Path, family: str = "llama", **over: str) -> tuple[Path, Path]:
    """`python -m jaxzero.train --model.name=hf:DIR --finetune.method=lora` (4 steps, float32 compute)
    over a tiny random float32 model of `family` (a Llama by default) that transformers saved: (the HF
    directory, the run directory)."""
    import io

    from jaxzero.cli import train as train_lib
    from jaxzero.overrides import apply_overrides

    hf_dir = tmp_path / "hf"
    torch_model(family).save_pretrained(hf_dir)
    settings = {
        "model.name": f"hf:{hf_dir}",
        "model.compute_dtype": "float32",
        "finetune.method": "lora",
        "finetune.lora_rank": "4",
        "finetune.lora_targets": "q,v,down",
        "data.source": "synthetic",
        "data.seq_len": str(SEQ),
        "data.batch_size": "4",
        "steps": "4",
        "optimizer.lr": "1e-2",
        "optimizer.warmup_steps": "0",
        "logging.progress": "false",
        "logging.samples": "0",
        "run_dir": str(tmp_path / "run"),
    }
    run = train_lib.train(apply_overrides(TrainConfig(), settings | over), io.StringIO())
    return hf_dir, run


@pytest.mark.parametrize(
    "family, targets", [("llama", "q,v,down"), ("phi3", "qkv,gate_up"), ("olmo2", "q,k,v,o,gate,up,down")]
)
def test_a_lora_run_of_an_hf_checkpoint_exports_what_peft_loads(
    tmp_path: Path, family: str, targets: str
) -> None:
    """The user's path: `python -m jaxzero.train --model.name=hf:DIR --finetune.method=lora` trains
    and saves; `python -m jaxzero.export` writes the adapter; PEFT over the same checkpoint gives the
    logits of jaxzero's merged model (`--merge`'s), and the adapters moved from their init. Phi-3's
    adapters are on its fused qkv_proj and gate_up_proj, PEFT's targets."""
    from jaxzero.cli import export as export_lib
    from jaxzero.storage.checkpoint_masters import load_masters

    over = {"finetune.base_dtype": "float32", "finetune.lora_targets": targets}
    hf_dir, run = lora_run_over_hf(tmp_path, family, **over)
    assert export_lib.main([f"--run_dir={run}", f"--out={tmp_path / 'adapter'}"]) == 0
    peft_model = peft.PeftModel.from_pretrained(load_torch(hf_dir), tmp_path / "adapter").eval()
    saved_cfg, merged, _ = load_masters(run)
    ours = jax_logits(Llama(saved_cfg.model), jax.tree.map(jnp.asarray, merged))
    theirs = torch_logits(peft_model)
    assert max_diff(ours, theirs) <= 1e-4
    assert max_diff(theirs, torch_logits(load_torch(hf_dir))) > 1e-3  # the trained adapters change them


def test_merge_is_into_the_float32_base_the_user_gave(tmp_path: Path, capsys) -> None:
    """A LoRA run over a float32 HF base trains over a bfloat16 copy (`finetune.base_dtype`'s default);
    `export --merge --dtype=float32` merges into the base as its files hold it, so transformers' logits
    of the merged export equal PEFT's adapter over the user's float32 base (the bfloat16 copy's merge
    is ~1e-3 away), and the message says which base it merged into. `export_state` merges alike."""
    from jaxzero import build_trainer, export_state, restore_state
    from jaxzero.cli import export as export_lib
    from jaxzero.storage.checkpoint_masters import load_masters

    hf_dir, run = lora_run_over_hf(tmp_path)
    saved_cfg, as_trained, _ = load_masters(run)
    assert saved_cfg.finetune.base_dtype == "bfloat16"
    assert export_lib.main([f"--run_dir={run}", f"--out={tmp_path / 'adapter'}"]) == 0
    merged_dir = tmp_path / "merged"
    assert export_lib.main([f"--run_dir={run}", f"--out={merged_dir}", "--merge", "--dtype=float32"]) == 0
    assert f"the adapters merged into the base read from {hf_dir}" in capsys.readouterr().out
    theirs = torch_logits(peft.PeftModel.from_pretrained(load_torch(hf_dir), tmp_path / "adapter").eval())
    assert max_diff(torch_logits(load_torch(merged_dir)), theirs) <= LOGIT_ATOL
    trained_over = jax_logits(Llama(saved_cfg.model), jax.tree.map(jnp.asarray, as_trained))
    assert max_diff(trained_over, theirs) > 10 * LOGIT_ATOL  # the bfloat16 copy's merge is not it
    # The library's export of the restored state writes the same merged model.
    trainer = build_trainer(saved_cfg)
    state = restore_state(trainer, run)[0]
    export_state(trainer, state, tmp_path / "state", format="hf", dtype="float32")
    written = (tmp_path / "state" / "model.safetensors").read_bytes()
    assert written == (merged_dir / "model.safetensors").read_bytes()

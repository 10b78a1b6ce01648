"""Generation: decoding over the key/value cache equals the full forward pass, greedy decoding equals
transformers' generate, nucleus sampling keeps what it should, streamed blocks change nothing, and the
CLI reads a run."""

from __future__ import annotations

import dataclasses
import gc
import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxzero import decode
from jaxzero.cli import generate as gen_lib
from jaxzero.config import ConfigError, ModelConfig, TrainConfig
from jaxzero.data.tokenizer import ByteTokenizer, TextCodec
from jaxzero.decode import Generator, Sampling, sample_next
from jaxzero.models import build_model, forward, layer_input
from jaxzero.overrides import apply_overrides

VARIANTS = {
    "llama": {},
    "gpt2": {},
    "qwen2-llama3-rope": dict(
        attention_bias=True,
        hf_model_type="qwen2",
        rope_type="llama3",
        rope_factor=8.0,
        rope_original_max_len=16,
    ),
    "qwen3": dict(qk_norm=True, head_size=48, hf_model_type="qwen3"),
    # Qwen3-MoE: each token routed to 2 of 4 experts, in the prefill as in each single-token step.
    "qwen3_moe": dict(
        qk_norm=True,
        head_size=48,
        hf_model_type="qwen3_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
    ),
    # Granite MoE: the four scalars (scores times 1/8 where 1/sqrt(head_dim) is 1/sqrt(32)), a tied
    # head, 2 of 4 experts.
    "granitemoe": dict(
        tie_embeddings=True,
        hf_model_type="granitemoe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.125,
        logits_scaling=6.0,
    ),
    # Phi-3: fused q/k/v and gate/up, rope over the first half of each head, every layer within a
    # window of 4; OLMo 2: norms after each sub-block, q/k norms over the whole projections.
    "phi3": dict(fused_projections=True, partial_rotary_factor=0.5, sliding_window=4, hf_model_type="phi3"),
    "olmo2": dict(qk_norm=True, qk_norm_scope="projection", post_norm=True, hf_model_type="olmo2"),
    # Gemma 3: layers 0 and 2 local (window 4), 1 and 3 global, each with its rope base.
    "gemma3": dict(
        family="gemma3",
        tie_embeddings=True,
        head_size=48,
        sliding_window=4,
        sliding_window_pattern=2,
        rope_local_theta=1e4,
        query_pre_attn_scalar=24,
        final_logit_softcap=30.0,
        hf_model_type="gemma3_text",
    ),
    # gpt-oss: layers 0 and 2 local (window 4), 1 and 3 global; sinks, yarn rope, biased experts.
    "gpt_oss": dict(
        family="gpt_oss",
        head_size=48,
        attention_bias=True,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        sliding_window=4,
        sliding_window_pattern=2,
        rope_type="yarn",
        rope_factor=32.0,
        rope_original_max_len=64,
        hf_model_type="gpt_oss",
    ),
}


def tiny(name: str) -> tuple:
    base = ModelConfig.named("gpt2-tiny" if name == "gpt2" else "llama-tiny")
    cfg = dataclasses.replace(base, compute_dtype="float32", attention_impl="xla", **VARIANTS[name])
    model = build_model(cfg)
    return cfg, model, jax.device_get(model.init(jax.random.key(0)))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_cached_decoding_equals_the_full_forward_pass(name):
    """A prefill of 8 positions, then 4 single tokens: each position's logits equal those of the whole
    sequence's forward pass."""
    cfg, model, params = tiny(name)
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, cfg.vocab_size)
    with jax.default_matmul_precision("highest"):
        full = np.asarray(forward(model, params, tokens))
        caches = [model.init_cache(2, 16) for _ in params.blocks]

        def run(tok, pos):
            x = model.embed_step(params.embed, tok, jnp.int32(pos))
            for i, p in enumerate(params.blocks):
                layer = () if layer_input(model, i) is None else (layer_input(model, i),)
                x, caches[i] = model.block_step(p, x, caches[i], jnp.int32(pos), *layer)
            return np.asarray(model.head(params.head, params.embed, x))

        np.testing.assert_allclose(run(tokens[:, :8], 0), full[:, :8], atol=1e-5, rtol=0)
        for t in range(8, 12):
            np.testing.assert_allclose(run(tokens[:, t : t + 1], t)[:, 0], full[:, t], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_generation_is_the_argmax_of_the_full_forward_pass(name):
    cfg, model, params = tiny(name)
    prompt = [3, 17, 42, 7, 99]
    with jax.default_matmul_precision("highest"):
        got = Generator(cfg, params, 32).generate(prompt, Sampling(max_new_tokens=10))
        seq = list(prompt)
        for _ in range(10):
            seq.append(int(np.argmax(np.asarray(forward(model, params, jnp.asarray([seq])))[0, -1])))
    assert got == seq[len(prompt) :]


def test_streamed_blocks_generate_the_same(monkeypatch):
    cfg, _, params = tiny("llama")
    sampling = Sampling(max_new_tokens=12, temperature=0.9, top_p=0.9, seed=3)
    resident = Generator(cfg, params, 32)
    monkeypatch.setattr(decode, "_fits", lambda device, needed: False)
    streamed = Generator(cfg, params, 32)
    assert streamed.streamed and not resident.streamed
    assert {b.sharding.memory_kind for b in jax.tree.leaves(streamed.blocks)} == {"pinned_host"}
    assert streamed.generate([1, 2, 3], sampling) == resident.generate([1, 2, 3], sampling)


def test_nucleus_sampling_keeps_the_top_p_and_follows_the_temperature():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 40000))
    draws = np.asarray(sample_next(logits, jax.random.key(0), 1.0, 0.7))
    # the smallest set reaching 0.7 is {0, 1}; renormalised: 0.625, 0.375
    assert set(np.unique(draws)) == {0, 1}
    assert np.mean(draws == 0) == pytest.approx(0.625, abs=0.01)
    draws = np.asarray(sample_next(logits, jax.random.key(1), 1.0, 1.0))
    np.testing.assert_allclose(
        np.bincount(draws, minlength=4) / draws.size, [0.5, 0.3, 0.15, 0.05], atol=0.01
    )
    hot = np.asarray(sample_next(logits, jax.random.key(2), 0.5, 1.0))  # p^2 renormalised
    assert np.mean(hot == 0) == pytest.approx(0.25 / (0.25 + 0.09 + 0.0225 + 0.0025), abs=0.01)
    assert (np.asarray(sample_next(logits[:3], jax.random.key(3), 0.0, 0.5)) == 0).all()


def test_greedy_generation_matches_transformers(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from jaxzero.interop import import_hf

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )
    ).eval()
    with torch.no_grad():  # larger weights than the init's, so that the argmax is not a near tie
        for p in hf.parameters():
            p.mul_(8.0 if p.ndim > 1 else 1.0)
    hf.save_pretrained(tmp_path)
    prompt = [5, 9, 33, 2, 77, 14]
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=0)
    cfg, params = import_hf(tmp_path)
    cfg = dataclasses.replace(cfg, compute_dtype="float32", attention_impl="xla")
    with jax.default_matmul_precision("highest"):
        got = Generator(cfg, params, 64).generate(prompt, Sampling(max_new_tokens=16))
    assert got == want[0, len(prompt) :].tolist()


def test_bad_requests_are_refused():
    cfg, _, params = tiny("llama")
    g = Generator(cfg, params, 8)
    with pytest.raises(ConfigError, match="the prompt is empty"):
        g.generate([], Sampling())
    with pytest.raises(ConfigError, match="the prompt has 8 tokens; the model continues at most 8"):
        g.generate(list(range(8)), Sampling())
    # each message names the one value that is wrong (they listed every condition)
    with pytest.raises(ConfigError, match=r"^top_p=1.5 must be in \(0, 1\] \(1: the whole distribution\).$"):
        g.generate([1], Sampling(top_p=1.5))
    for t in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ConfigError, match=rf"^temperature={t} must be >= 0 and finite \(0: greedy\).$"):
            g.generate([1], Sampling(temperature=t))
    with pytest.raises(ConfigError, match=r"^max_new_tokens=0 must be >= 1.$"):
        g.generate([1], Sampling(max_new_tokens=0))


def _builtin_run(run_dir, steps: int):
    """(run directory, console text) of a tiny run on the built-in corpus, which ends with samples."""
    from jaxzero.cli import train as train_lib

    over = {
        "steps": str(steps),
        "data.seq_len": "16",
        "data.batch_size": "4",
        "model.num_layers": "1",
        "logging.progress": "false",
        "run_dir": str(run_dir),
    }
    console = io.StringIO()
    return train_lib.train(apply_overrides(TrainConfig(), over), console), console.getvalue()


def test_a_run_on_the_builtin_corpus_ends_with_samples_and_the_cli_reads_it(tmp_path, capsys):
    path, out = _builtin_run(tmp_path / "run", steps=3)
    assert (
        "jaxzero: samples of step 3" in out and "--- 'def '\ndef " in out and "--- 'import '\nimport " in out
    )
    assert gen_lib.main([f"--run_dir={path}", "--prompt=for i in", "--max_new_tokens=5"]) == 0
    printed = capsys.readouterr().out
    assert f"{path} step 3" in printed and "--- 'for i in'\nfor i in" in printed
    assert gen_lib.main([f"--run_dir={tmp_path / 'nowhere'}", "--prompt=x"]) == 2
    assert "nowhere' does not exist" in capsys.readouterr().err
    assert json.loads((path / "summary.json").read_text())["status"] == "complete"


def test_ids_past_the_bytes_decode_as_replacement_characters():
    """A model trained on bytes with a wider vocabulary can sample an id past 255: the byte-level
    decoder writes it as U+FFFD (as it writes a byte that is no UTF-8) instead of failing."""
    codec = TextCodec(ByteTokenizer(), stop_id=None)
    assert codec.decode(list("héllo".encode())) == "héllo"
    assert codec.decode([104, 300, *"é".encode(), 999, 256]) == "h\ufffdé\ufffd\ufffd"
    assert codec.decode([0xC3, 700, 0xA9]) == "\ufffd\ufffd\ufffd"  # a split character stays split


def test_a_run_whose_samples_fail_still_ends_complete(tmp_path, monkeypatch):
    """The end-of-run samples come after the final checkpoint and summary: a sampler that fails
    (a kernel that refuses the decoder's shapes) is reported as a warning, and the run still
    returns its directory, complete, its checkpoint readable."""
    from jaxzero.run import samples

    class Failing:
        def __init__(self, *args, **kwargs):
            raise ValueError("the decoder's rows are no multiple of the kernel's tile")

    monkeypatch.setattr(samples, "Generator", Failing)
    path, out = _builtin_run(tmp_path / "run", steps=2)
    assert "jaxzero: warning: the end-of-run samples failed (ValueError: the decoder's rows" in out
    assert f"python -m jaxzero.generate --run_dir={path}" in out
    assert json.loads((path / "summary.json").read_text())["status"] == "complete"
    assert (path / "checkpoints" / "2").is_dir()


@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_the_trainers_state_is_released_before_the_samples_read_the_weights(tmp_path, monkeypatch, offload):
    """The end-of-run samples read the checkpoint's float32 weights whole; the trainer's state
    (masters, moments; on the host too when offloaded) is released first, so that the run's peak RAM
    is the training's, as the plan counts it: when the sampler starts, the arrays alive hold less than
    the weights twice over beyond those alive before the run, where the state alone holds them three
    times (AdamW's two moments)."""
    from jaxzero.models.sizes import param_count
    from jaxzero.run import samples

    seen = []
    real = samples.Generator

    def live_bytes() -> int:  # of the arrays alive in this process, earlier tests' included
        gc.collect()
        return sum(a.nbytes for a in jax.live_arrays())

    def counting(model, params, *args, **kwargs):
        seen.append((live_bytes() - before, 4 * param_count(model)))
        return real(model, params, *args, **kwargs)

    monkeypatch.setattr(samples, "Generator", counting)
    over = {"offload.params": offload, "offload.optimizer": offload}
    from jaxzero.cli import train as train_lib

    cfg = apply_overrides(
        TrainConfig(),
        {"steps": "2", "data.seq_len": "16", "data.batch_size": "4", "model.num_layers": "2",
         "logging.progress": "false", "logging.samples": "1", "run_dir": str(tmp_path / "run"), **over},
    )  # fmt: skip
    out = io.StringIO()
    before = live_bytes()
    train_lib.train(cfg, out)
    assert "jaxzero: samples of step 2" in out.getvalue()
    ((live, weights),) = seen
    assert live < 2 * weights, (live, weights)

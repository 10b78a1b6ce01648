"""Document-aware attention: in a window of several documents, each ended by the end-of-text id, every
token attends only within its own document, so each document's losses are those of the document
evaluated alone; resident and offloaded alike, in evaluation and in a training step.

Tolerances are the float32 ones of test_models (outputs within 1e-5 relative: the losses here, of
parameters that keep activations O(1), are tens, not test_offload's ~5) and test_offload (a step's
parameters and gradient norm within 2e-5 relative): a document inside a packed row and the same
document alone run the same math over differently shaped arrays (and Llama's rotary angles at other
absolute positions), so they agree to rounding, not bitwise. GPT-2 keeps its learned absolute
positions in a packed row (it was pre-trained that way), so where its documents are compared with
themselves alone, its position table is made the same at every position: what is tested is the
attention, which alone changes.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxzero.config import ConfigError, DataConfig, TrainConfig
from jaxzero.models import ModelParams, build_model, forward
from jaxzero.numerics.objective import decode_window, document_eot, document_segments
from jaxzero.offload.streaming import StreamedModel
from jaxzero.overrides import apply_overrides
from jaxzero.plan import placement
from jaxzero.trainer import build_trainer

EOT = 3
SEQ = 32
DOCS = (7, 11, 5, 6)  # token counts, each ending with EOT; the row's tail starts a fifth document
LOSS_RTOL, PARAM_TOL = 1e-5, 2e-5
OFFLOAD = {"offload.optimizer": "cpu", "offload.params": "cpu"}


def tiny(family: str, **over: str) -> TrainConfig:
    return apply_overrides(
        TrainConfig(),
        {
            "model.name": f"{family}-tiny",
            "model.num_layers": "3",
            "model.compute_dtype": "float32",
            "data.seq_len": str(SEQ),
            "data.batch_size": "4",
            "data.grad_accum": "2",
            "data.eot_id": str(EOT),
            "optimizer.lr": "1e-2",
            **over,
        },
    )


def document(rng: np.random.Generator, length: int, vocab: int) -> list[int]:
    body = rng.integers(EOT + 1, vocab, length - 1).tolist()
    return [*body, EOT]


def packed_row(seed: int, vocab: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """An int32 (SEQ+1,) window of whole documents and a fifth cut by the row's end, and the
    [start, end) window positions of each document (the last runs to the row's end)."""
    rng = np.random.default_rng(seed)
    row, spans = [], []
    for n in DOCS:
        spans.append((len(row), len(row) + n))
        row += document(rng, n, vocab)
    spans.append((len(row), SEQ + 1))
    row += rng.integers(EOT + 1, vocab, SEQ + 1 - len(row)).tolist()
    return np.asarray(row, np.int32), spans


def alone(row: np.ndarray, span: tuple[int, int]) -> np.ndarray:
    """The window of one document alone: its tokens, then the token after it as the last target."""
    start, end = span
    return row[start : min(end + 1, SEQ + 1)][None]


def random_params(family: str) -> ModelParams:
    """float32 NumPy params with O(1) activations (kernels ~ N(0, 1/fan_in), as test_models makes them),
    so attention is far from uniform and a leak across documents shows; GPT-2's position table gives
    every position row 0's embedding (see the module docstring)."""
    rng = np.random.default_rng(0)
    shapes = jax.eval_shape(build_model(tiny(family).model).init, jax.random.key(0))

    def fill(path, leaf):
        name = path[-1].key
        if name == "kernel":
            return (rng.standard_normal(leaf.shape) / math.sqrt(leaf.shape[0])).astype(np.float32)
        if name == "embedding":
            return rng.standard_normal(leaf.shape).astype(np.float32)
        if name == "scale":
            return (1.0 + 0.2 * rng.standard_normal(leaf.shape)).astype(np.float32)
        return (0.1 * rng.standard_normal(leaf.shape)).astype(np.float32)

    params = jax.tree_util.tree_map_with_path(fill, shapes)
    if family == "gpt2":
        wpe = params.embed["wpe"]["embedding"]
        params.embed["wpe"]["embedding"] = np.ascontiguousarray(np.broadcast_to(wpe[:1], wpe.shape))
    return params


def token_losses(model, params: ModelParams, window: np.ndarray, eot_id: int | None) -> np.ndarray:
    """float32 (B, S) next-token cross-entropy of every target of int32 (B, S+1) windows."""

    @jax.jit
    def run(p, w):
        inputs, targets, _ = decode_window(w)
        segments = None if eot_id is None else document_segments(w, eot_id)
        logits = forward(model, p, inputs, segments)
        picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        return jax.nn.logsumexp(logits, axis=-1) - picked

    return np.asarray(run(params, jnp.asarray(window)))


def model_and_params(family: str):
    cfg = tiny(family)
    return cfg, build_model(cfg.model), random_params(family)


def test_segments_count_the_end_of_text_ids_before_each_input():
    window = jnp.asarray([[5, 6, EOT, 7, ~8, EOT, EOT, 9, 4], [EOT, ~5, 6, 7, 8, 9, 4, 5, EOT]], jnp.int32)
    segments = np.asarray(document_segments(window, EOT))
    np.testing.assert_array_equal(segments, [[0, 0, 0, 1, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1, 1]])
    assert segments.dtype == np.int32
    # Batches of micro-batches: the last axis is the sequence.
    np.testing.assert_array_equal(document_segments(window[None], EOT)[0], segments)


def test_which_runs_attend_within_documents():
    model = build_model(tiny("llama").model)
    assert document_eot(DataConfig(eot_id=EOT), model) == EOT
    assert document_eot(DataConfig(eot_id=EOT, cross_document_attention=True), model) is None
    assert document_eot(DataConfig(eot_id=-2), model) is None
    assert document_eot(DataConfig(eot_id=-1), model) is None  # unresolved: what the data says comes later

    class OwnModel:  # a model of one's own whose block takes no segments
        def block(self, params, x):
            return x

    with pytest.raises(ConfigError, match="cross_document_attention=true"):
        document_eot(DataConfig(eot_id=EOT), OwnModel())
    assert document_eot(DataConfig(eot_id=EOT, cross_document_attention=True), OwnModel()) is None


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_each_document_scores_as_it_does_alone(family):
    """Per-token losses of every document of a packed row equal those of the document alone; with
    attention across the row (no segments) the later documents' losses do not."""
    cfg, model, params = model_and_params(family)
    rows = [packed_row(seed, cfg.model.vocab_size) for seed in (1, 2)]
    window = np.stack([r for r, _ in rows])
    packed = token_losses(model, params, window, EOT)
    across = token_losses(model, params, window, None)
    for b, (row, spans) in enumerate(rows):
        for i, span in enumerate(spans):
            start, end = span[0], min(span[1], SEQ)
            single = token_losses(model, params, alone(row, span), None)[0]
            np.testing.assert_allclose(packed[b, start:end], single, rtol=LOSS_RTOL)
            if i > 0:
                assert np.abs(across[b, start:end] / single - 1).max() > 1e-3  # the test sees leaks
    np.testing.assert_array_equal(packed[:, : DOCS[0]], across[:, : DOCS[0]])  # the first: nothing before it


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_gradients_stay_within_documents(family):
    """The gradient of one document's loss reaches the activations of that document only, and every
    parameter through it."""
    cfg, model, params = model_and_params(family)
    row, spans = packed_row(3, cfg.model.vocab_size)
    window = jnp.asarray(row[None])
    inputs, targets, _ = decode_window(window)
    segments = document_segments(window, EOT)
    start, end = spans[1]

    def doc_loss(p, x):
        for bp in p.blocks:
            x = model.block(bp, x, segments)
        logits = model.head(p.head, p.embed, x)
        picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        return jnp.sum((jax.nn.logsumexp(logits, axis=-1) - picked)[:, start:end])

    g_params, g_x = jax.jit(jax.grad(doc_loss, argnums=(0, 1)))(params, model.embed(params.embed, inputs))
    g_x = np.abs(np.asarray(g_x[0])).max(axis=-1)
    assert (g_x[:start] == 0).all() and (g_x[end:] == 0).all()
    assert (g_x[start:end] > 0).all()
    for g in jax.tree.leaves(g_params.blocks):
        assert bool(jnp.isfinite(g).all()) and float(jnp.abs(g).max()) > 0


def masked_to(row: np.ndarray, span: tuple[int, int]) -> np.ndarray:
    """The row with only the targets of inputs in `span` counted (the others marked `~id`)."""
    start, end = span[0], min(span[1], SEQ)
    out = ~row
    out[start + 1 : end + 1] = row[start + 1 : end + 1]
    out[0] = row[0]
    return out


def eval_rows(family: str) -> tuple[np.ndarray, list[list[tuple[int, int]]]]:
    vocab = tiny(family).model.vocab_size
    rows = [packed_row(seed, vocab) for seed in (4, 5, 6, 7)]
    return np.stack([r for r, _ in rows]), [s for _, s in rows]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("mode", ["resident", "offload"])
def test_trainers_evaluate_each_document_as_alone(family, mode):
    """`eval_loss` of a packed window counting one document's targets is that document's mean loss
    alone, in the resident trainer and under full offload."""
    cfg = tiny(family, **(OFFLOAD if mode == "offload" else {}))
    trainer = build_trainer(cfg, placement.make_mesh(jax.devices()[:1]))
    params = random_params(family)
    state = trainer.init_from_params(params)
    model = build_model(cfg.model)
    rows, spans = eval_rows(family)
    for i in range(len(DOCS) + 1):
        window = np.stack([masked_to(row, s[i]) for row, s in zip(rows, spans)])
        got = float(jax.device_get(trainer.eval_loss(state, trainer.put_eval_batch(window))))
        singles = [token_losses(model, params, alone(row, s[i]), None)[0] for row, s in zip(rows, spans)]
        np.testing.assert_allclose(got, np.mean(np.concatenate(singles)), rtol=LOSS_RTOL)


def one_step(family: str, batch: np.ndarray, **over: str):
    cfg = tiny(family, **over)
    trainer = build_trainer(cfg, placement.make_mesh(jax.devices()[:1]))
    state = trainer.init_from_params(random_params(family))
    state, m = trainer.step(state, trainer.put_batch(batch))
    m = jax.device_get(m)
    return trainer, jax.device_get(state.params), float(m.loss), float(m.grad_norm)


def train_batch(family: str) -> np.ndarray:
    rows, _ = eval_rows(family)
    rows[:, 1::3] = ~rows[:, 1::3]  # a fine-tuning batch: some targets not counted
    return rows.reshape(2, 2, SEQ + 1)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_offloaded_step_matches_resident_with_documents(family, monkeypatch):
    """One training step over packed documents: the offloaded step equals the resident one, the
    segments change the step (they are used), and the streamed block programs are still compiled once
    for every layer."""
    built = []
    init = StreamedModel.__init__

    def recording(self, *args, **kwargs):
        built.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(StreamedModel, "__init__", recording)
    batch = train_batch(family)
    _, ref, ref_loss, ref_norm = one_step(family, batch)
    _, got, loss, norm = one_step(family, batch, **OFFLOAD)
    np.testing.assert_allclose(loss, ref_loss, rtol=LOSS_RTOL)
    np.testing.assert_allclose(norm, ref_norm, rtol=PARAM_TOL)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a - b) <= PARAM_TOL * np.linalg.norm(b)
    (streamed,) = built
    assert streamed._block_fwd._cache_size() == 1 and streamed._block_bwd._cache_size() == 1
    _, _, across, _ = one_step(family, batch, **{"data.cross_document_attention": "true"})
    assert abs(across / ref_loss - 1) > 1e-3


@pytest.mark.parametrize("mode", ["resident", "offload"])
def test_cross_document_attention_is_the_unsegmented_computation(mode):
    """`data.cross_document_attention=true` runs exactly what a run without an end-of-text id runs
    (the programs of before document-aware attention): bitwise the same losses and parameters."""
    over = OFFLOAD if mode == "offload" else {}
    batch = train_batch("llama")
    _, p_across, loss_across, norm_across = one_step(
        "llama", batch, **over, **{"data.cross_document_attention": "true"}
    )
    _, p_none, loss_none, norm_none = one_step("llama", batch, **over, **{"data.eot_id": "-2"})
    assert (loss_across, norm_across) == (loss_none, norm_none)
    for a, b in zip(jax.tree.leaves(p_across), jax.tree.leaves(p_none)):
        np.testing.assert_array_equal(a, b)

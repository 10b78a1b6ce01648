"""Check a LoRA run's PEFT export the way a user loads it: `transformers` + `peft` over the run's base.

    python -m jaxzero.export --run_dir=RUN --out=ADAPTER
    python scripts/check_peft_reload.py --run_dir=RUN --adapter=ADAPTER --base_out=BASE

Writes the run's frozen base (as it was trained: narrowed to `finetune.base_dtype`, widened back) as a
Hugging Face checkpoint in BASE, loads it with `transformers` in float32 (on CUDA if there is one, TF32
off) with the adapter through `peft.PeftModel.from_pretrained`, and compares its logits on a fixed
sequence with jaxzero's merged model (the run's checkpoint read as `python -m jaxzero.export --merge`
reads it; float32, highest matmul precision). Prints the largest difference, against
how far the adapter moves the base's logits.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

# JAX and torch share the GPU: JAX takes memory as it needs it and returns what it frees.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run_dir", required=True)
    ap.add_argument("--adapter", required=True, help="the run's PEFT export (python -m jaxzero.export)")
    ap.add_argument("--base_out", required=True, help="a new directory for the base as a HF checkpoint")
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    import peft
    import torch
    import transformers

    from jaxzero.finetune.merged import merged_units
    from jaxzero.interop import export_hf
    from jaxzero.models import build_model, forward
    from jaxzero.storage.checkpoint_masters import load_masters, saved_adapters

    cfg, _, step = saved_adapters(args.run_dir)
    if not os.path.exists(os.path.join(args.base_out, "config.json")):  # an earlier check's base is reused
        export_hf(merged_units(cfg, lambda k: {}), cfg.model, args.base_out, dtype="float32")  # no adapter
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (1, args.tokens), dtype=np.int32)
    saved_cfg, merged, _ = load_masters(args.run_dir)
    model = build_model(dataclasses.replace(saved_cfg.model, compute_dtype="float32"))
    with jax.default_matmul_precision("highest"):
        ours = np.asarray(forward(model, jax.tree.map(jnp.asarray, merged), jnp.asarray(tokens)))
    del merged
    print(f"jaxzero's logits of step {step}: done", flush=True)

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = "cuda" if torch.cuda.is_available() else "cpu"
    base = transformers.AutoModelForCausalLM.from_pretrained(args.base_out, dtype=torch.float32).to(device)
    with torch.no_grad():
        ids = torch.from_numpy(tokens).long().to(device)
        plain = base(ids).logits.float().cpu().numpy()
        adapted = peft.PeftModel.from_pretrained(base, args.adapter).eval()
        theirs = adapted(ids).logits.float().cpu().numpy()
    diff = float(np.max(np.abs(ours - theirs)))
    moved = float(np.max(np.abs(theirs - plain)))
    scale = float(np.max(np.abs(theirs)))
    result = {"step": step, "max_abs_diff": diff, "adapter_moves_logits_by": moved, "max_abs_logit": scale}
    print(json.dumps(result))
    print(
        f"PEFT over the base vs jaxzero's merged model: max |diff| {diff:.3g} (logits up to {scale:.3g}); "
        f"the adapter moves the base's logits by up to {moved:.3g}"
    )


if __name__ == "__main__":
    main()

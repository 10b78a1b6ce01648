r"""DeepSpeed's side of the side-by-side benchmark: the model of `bench_offload.py --cases=step` trained
by DeepSpeed ZeRO on one GPU, with the same accounting, so the two tables compare line by line.

Each case runs in its own process (clean peak-memory and RSS readings); the parent prints one table.

    python3 scripts/bench_deepspeed.py --out=$OUT
    python3 scripts/bench_deepspeed.py --cases=zero3-offload --warmup=3 --steps=10 --out=$OUT
    python3 scripts/bench_deepspeed.py --cases=zero3-offload \
        --ds zero_optimization.stage3_prefetch_bucket_size=2e8 --ds zero_optimization.overlap_comm=false

Cases (all stage-2/3 ZeRO with a `bf16` section: bf16 weights and compute, fp32 master weights and AdamW
moments kept by DeepSpeed)
  resident        ZeRO stage 2, no offload: weights, masters, moments and gradients on the GPU, DeepSpeed's
                  FusedAdam (the reference of the "vs resident" column)
  zero2-offload   ZeRO stage 2 + offload_optimizer cpu (pinned): masters and moments in host RAM,
                  DeepSpeedCPUAdam on the host (ZeRO-Offload)
  zero3-offload   ZeRO stage 3 + offload_param cpu + offload_optimizer cpu (pinned): bf16 weights live in
                  host RAM too and are fetched block by block; the model is built inside
                  `deepspeed.zero.Init` so it never exists whole on one device

The model: transformers' `LlamaForCausalLM`, random init, sdpa attention, untied embeddings, RMSNorm,
rope, gradient checkpointing per decoder layer (`gradient_checkpointing_enable()`); by default the shape
of jaxzero's `llama-3.4b-bench` (hidden 3072, 28 layers, MLP 8192, 24 heads with 24 kv heads, vocab
32000: 3,367,676,928 parameters) at 8 x 2048 = 16,384 random tokens per step. AdamW (lr 1e-4, betas
0.9/0.95, eps 1e-8, weight decay 0.1 on every parameter) from DeepSpeed's own `optimizer` section, exact
gradient clipping at 1.0, one micro-batch per step. Each step is timed between two
`torch.cuda.synchronize()` calls; the table gives the median and mean of the steps after `--warmup`.

FLOP accounting: "TFLOP/s (8N)" counts 8 x params x tokens per step (forward, recomputed forward,
backward), as `bench_offload.py` does; N is counted from the built model (`ds_numel` under ZeRO-3),
less, with experts, those outside each token's top-k.
GPU GiB is `torch.cuda.max_memory_allocated` over the whole process (rsv: `max_memory_reserved`); RSS
GiB is the process's peak resident set (VmHWM in /proc/self/status), pinned host buffers included.

JIT-built ops: DeepSpeed compiles DeepSpeedCPUAdam (g++, ninja) and FusedAdam (nvcc) on first use into
TORCH_EXTENSIONS_DIR, which the parent sets to /tmp/torch_extensions_deepspeed unless it is set already:
the first case that uses each op pays its build in its init time, not in its steps. If FusedAdam will
not build, `--cases=resident --ds optimizer.params.torch_adam=true` runs the resident case with
torch.optim.AdamW instead (`--ds` applies to every case named: on the offload cases it would replace
DeepSpeedCPUAdam too).
The resident case holds about 18-20 bytes per parameter on the GPU (bf16 weights and gradients, fp32
masters, both moments and the fp32 gradient of the step) plus activations: at the default shape it
fits a 141 GB H200 but may not fit an 80 GB H100.

Installing DeepSpeed on a GPU box without network access: `.whl/` in the repository root holds
DeepSpeed 0.19.8 as a pure-Python wheel (built from its sdist with DS_BUILD_OPS=0, so its ops are
JIT-built as above) and the packages it needs that the box lacks (hjson, pydantic, pydantic-core,
annotated-types, typing-inspection), as CPython 3.12 manylinux x86_64 or pure-Python wheels; torch,
numpy, transformers and DeepSpeed's other needs (ninja, psutil, py-cpuinfo, msgpack, einops, tqdm,
packaging, typing-extensions) come from the box. Carry `.whl` to the box, then:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
    python3 scripts/bench_deepspeed.py --out=$OUT

`.whl/` is made where pip reaches its index (torch installed, for DeepSpeed's setup.py). pydantic 2.11
is chosen for its low typing-extensions floor (4.12.2; 2.12 and later need 4.14.1 or newer), since the
box's own typing-extensions is used:

    DS_BUILD_OPS=0 python3 -m pip wheel --no-deps --no-build-isolation deepspeed==0.19.8 -w .whl
    python3 -m pip download --no-deps --only-binary=:all: -d .whl hjson==3.1.0 pydantic==2.11.10 \
        annotated-types==0.7.0 typing-inspection==0.4.2
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl pydantic-core==2.33.2

The Qwen3-MoE shape (`--shape=qwen3-moe`): transformers' `Qwen3MoeForCausalLM`, hidden 2048, 12
layers, 32 heads / 4 KV heads of 128 (q/k norms), 64 experts of width 768 (`--mlp`), top-8 renormalised,
vocab 151,936, untied: 4,474,328,064 parameters; default cases zero3-offload (CPU Adam, pinned) and
jaxzero's two beside it in the same run, same box:
  jaxzero-host    jaxzero's ZeRO-3 offload with every unit's state on the host (`bench_offload.py`'s
                  zero3-offload step case: offload.params=cpu, offload.optimizer=cpu,
                  offload.device_state_units=0)
  jaxzero-auto    the planner's placement for this machine (`bench_offload.py`'s auto case)
and, named in --cases, a third:
  jaxzero-host-bf16  jaxzero-host with bf16 moments (`optimizer.state_dtype=bfloat16`: 20 bytes of host
                  traffic per parameter against fp32's 28; DeepSpeed's CPU Adam keeps fp32 moments)
each the same shape (`jaxzero_overrides`), tokens and AdamW, checkpoints off, run by
`scripts/bench_offload.py --case=...` in its own process. "vs ZeRO-3" is DeepSpeed zero3-offload's
s/step over the case's (2.50x: 2.5 times its tokens/s). jaxzero cases run with `--shape=llama` too.

    python3 scripts/bench_deepspeed.py --shape=qwen3-moe --warmup=3 --steps=8 --out=$OUT

Single-GPU DeepSpeed without a launcher: each case process sets RANK=0, WORLD_SIZE=1, LOCAL_RANK=0,
MASTER_ADDR=127.0.0.1 and a free MASTER_PORT before `deepspeed.init_distributed()`. NVLink multicast
stays off (NCCL_NVLS_ENABLE=0 and its PyTorch/NVSHMEM twins are set where absent).
"""

from __future__ import annotations

# torch, transformers and DeepSpeed are imported inside the case process only: the parent starts one
# process per case and must not initialise CUDA itself.
import argparse
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time

CASES = ["resident", "zero2-offload", "zero3-offload"]
# jaxzero's cases: scripts/bench_offload.py's step case each runs as, and its own config overrides.
JAXZERO_CASES: dict[str, tuple[str, dict[str, str]]] = {
    "jaxzero-host": ("zero3-offload", {}),
    "jaxzero-host-bf16": ("zero3-offload", {"optimizer.state_dtype": "bfloat16"}),
    "jaxzero-auto": ("auto", {}),
}
# Each shape's defaults of the shape flags (mlp: a dense MLP's width, or each expert's).
SHAPES: dict[str, dict[str, int]] = {
    "llama": dict(hidden=3072, layers=28, mlp=8192, heads=24, kv_heads=0, head_dim=0, experts=0, top_k=0,
                  vocab=32000),
    "qwen3-moe": dict(hidden=2048, layers=12, mlp=768, heads=32, kv_heads=4, head_dim=128, experts=64,
                      top_k=8, vocab=151936),
}  # fmt: skip
DEFAULT_CASES = {"llama": ",".join(CASES), "qwen3-moe": "zero3-offload,jaxzero-host,jaxzero-auto"}
# The named sizes whose fields jaxzero's side overrides with the shape's.
JAXZERO_BASE = {"llama": "llama-3.4b-bench", "qwen3-moe": "qwen3-30b-a3b"}
# NVLink multicast can take a shared host's GPUs out of service: kept off unless set otherwise.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
DEFAULT_EXTENSIONS_DIR = "/tmp/torch_extensions_deepspeed"


def block_param_count(args: argparse.Namespace) -> int:
    """Parameters of one decoder layer of the shape: attention (with Qwen3-MoE's q/k norms), its two
    RMSNorms, and the dense MLP or the router and every expert."""
    d, hd = args.hidden, args.head_dim or args.hidden // args.heads
    attention = 2 * d * hd * (args.heads + args.kv_heads) + (2 * hd if args.experts else 0)
    mlp = d * args.experts + args.experts * 3 * d * args.mlp if args.experts else 3 * d * args.mlp
    return attention + mlp + 2 * d


def inactive_experts(args: argparse.Namespace) -> int:
    """Expert kernel parameters of the shape a token does not multiply by (0 without experts)."""
    return args.layers * max(args.experts - args.top_k, 0) * 3 * args.hidden * args.mlp if args.experts else 0


def shape_param_count(args: argparse.Namespace) -> int:
    """Parameters of the untied model of the shape: embedding, blocks, final norm, head."""
    return 2 * args.vocab * args.hidden + args.layers * block_param_count(args) + args.hidden


def resolve_shape(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with every shape flag left unset (None) taken from `--shape`'s defaults; kv_heads 0 is
    as many as heads."""
    for key, value in SHAPES[args.shape].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.kv_heads = args.kv_heads or args.heads
    return args


def hf_model_config(args: argparse.Namespace):  # -> transformers.PretrainedConfig
    """transformers' config of the shape: `LlamaConfig`, or `Qwen3MoeConfig` (every layer sparse)."""
    from transformers import LlamaConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(args.seq, 4096),
        tie_word_embeddings=False,
        use_cache=False,
    )
    if args.shape == "llama":
        rope = {"rope_type": "default", "rope_theta": 10000.0}
        return LlamaConfig(**common, intermediate_size=args.mlp, rms_norm_eps=1e-5, rope_parameters=rope)
    return Qwen3MoeConfig(
        **common,
        head_dim=args.head_dim,
        intermediate_size=args.mlp,  # no dense layer: decoder_sparse_step 1, mlp_only_layers empty
        moe_intermediate_size=args.mlp,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        rms_norm_eps=1e-6,
    )


def jaxzero_overrides(args: argparse.Namespace) -> dict[str, str]:
    """jaxzero's config overrides of the same shape: a named size of the family, its fields set."""
    over = {
        "model.name": JAXZERO_BASE[args.shape],
        "model.vocab_size": args.vocab,
        "model.hidden_size": args.hidden,
        "model.num_layers": args.layers,
        "model.num_heads": args.heads,
        "model.num_kv_heads": args.kv_heads,
        "model.head_size": args.head_dim,
        "model.tie_embeddings": "false",
    }
    if args.experts:
        over.update({"model.num_experts": args.experts, "model.num_experts_per_tok": args.top_k,
                     "model.moe_intermediate_size": args.mlp, "model.norm_topk_prob": "true"})  # fmt: skip
    else:
        over["model.intermediate_size"] = args.mlp
    return {k: str(v) for k, v in over.items()}


def ds_config(case: str, args: argparse.Namespace) -> dict:
    """The DeepSpeed config dict of `case` (one of CASES), `--ds` overrides applied last."""
    if case not in CASES:
        raise ValueError(f"unknown case {case!r}; the cases are {', '.join(CASES)}")
    block = block_param_count(args)
    pinned_cpu = {"device": "cpu", "pin_memory": True}
    zero: dict = {
        "stage": 3 if case == "zero3-offload" else 2,
        # Gradients are copied out (to the fp32 partition, on the host under offload) on a side stream
        # while the backward pass goes on, bucket by bucket; one decoder layer per bucket.
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_scatter": True,
        "reduce_bucket_size": block,
    }
    if case == "zero2-offload":
        zero["offload_optimizer"] = dict(pinned_cpu)
    if case == "zero3-offload":
        zero.update(
            {
                "offload_param": dict(pinned_cpu),
                "offload_optimizer": dict(pinned_cpu),
                # One decoder layer's weights fetched ahead, so the next layer's host-to-device copy
                # overlaps this layer's compute.
                "stage3_prefetch_bucket_size": block,
                # Tensors under this many elements (the RMSNorm weights) stay on the GPU.
                "stage3_param_persistence_threshold": 100_000,
                "stage3_max_live_parameters": 1_000_000_000,
                "stage3_max_reuse_distance": 1_000_000_000,
                "sub_group_size": 1_000_000_000,
            }
        )
    else:  # stage 2 gathers the updated bf16 weights after each step, one layer's worth at a time
        zero["allgather_bucket_size"] = block
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
        },
        "zero_optimization": zero,
        "steps_per_print": 1_000_000,  # DeepSpeed's own progress lines off; each step is printed here
        "wall_clock_breakdown": False,
    }
    for item in args.ds:
        set_dotted(config, item)
    return config


def set_dotted(config: dict, item: str) -> None:
    """Apply one `--ds KEY.PATH=VALUE` to `config` in place; VALUE is read as JSON where it parses
    (numbers, true/false, lists, objects; integral floats such as 2e8 become ints), else kept a string."""
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise ValueError(f"--ds {item!r}: expected KEY.PATH=VALUE, e.g. zero_optimization.overlap_comm=false")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    *parents, leaf = key.split(".")
    node = config
    for p in parents:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ValueError(f"--ds {item!r}: {p!r} holds {node!r}, not a section")
    node[leaf] = value


def host_memory_gib() -> tuple[float, float]:
    """(peak, current) resident set size of this process, GiB, from /proc/self/status (VmHWM, VmRSS)."""
    kib = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ("VmHWM", "VmRSS"):
                kib[name] = int(rest.split()[0])
    return kib.get("VmHWM", 0) / 2**20, kib.get("VmRSS", 0) / 2**20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_case(case: str, args: argparse.Namespace) -> dict:
    """Build the model and DeepSpeed engine of `case`, run warm-up + timed steps, return the result."""
    # One process, one GPU, no launcher: torch.distributed's env:// rendezvous with itself.
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"})
    os.environ["MASTER_PORT"] = str(_free_port())
    for k, v in NO_MULTICAST.items():
        os.environ.setdefault(k, v)

    import deepspeed
    import numpy as np
    import pydantic
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
        sync = torch.cuda.synchronize
    else:  # DeepSpeed's CPU accelerator: the same code path on a machine without a GPU
        device = torch.device("cpu")

        def sync() -> None:
            pass

    deepspeed.init_distributed()
    config = ds_config(case, args)
    print("DeepSpeed config " + json.dumps(config, indent=1), flush=True)

    model_config = hf_model_config(args)
    torch.manual_seed(0)
    zero3 = config["zero_optimization"]["stage"] == 3
    t0 = time.perf_counter()
    if zero3:
        # Registered (through a weak reference, so kept alive here) it makes transformers' from_config
        # build the model inside deepspeed.zero.Init(config_dict_or_path=config): each layer's weights
        # are partitioned (to pinned host RAM, offload_param) as soon as the layer exists, and the random
        # init runs on one gathered layer at a time.
        hf_zero3 = HfDeepSpeedConfig(config)
        model = AutoModelForCausalLM.from_config(
            model_config, dtype=torch.bfloat16, attn_implementation="sdpa"
        )
        whole = [n for n, p in model.named_parameters() if not hasattr(p, "ds_id")]
        if whole:
            raise RuntimeError(
                f"{len(whole)} parameters were not partitioned by deepspeed.zero.Init (first: {whole[:3]}); "
                f"transformers {transformers.__version__} did not take the ZeRO-3 path of from_config"
            )
    else:
        hf_zero3 = None
        with device:  # built on the GPU directly, in bf16: DeepSpeed keeps the fp32 masters
            model = AutoModelForCausalLM.from_config(
                model_config, dtype=torch.bfloat16, attn_implementation="sdpa"
            )
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    sync()
    build_s = time.perf_counter() - t0
    n = sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())
    expected = shape_param_count(args)
    if n != expected:
        print(f"WARNING: the model has {n:,} parameters, the shape's formula gives {expected:,}", flush=True)
    after_build = torch.cuda.memory_allocated() / 2**30 if cuda else 0.0

    t0 = time.perf_counter()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    engine.train()
    sync()
    init_s = time.perf_counter() - t0
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    print(
        f"engine ready in {init_s:.1f}s: ZeRO stage {engine.zero_optimization_stage()}, "
        f"{type(engine.optimizer).__name__} over {type(inner).__name__}",
        flush=True,
    )

    gen = torch.Generator(device=device).manual_seed(0)
    total = args.warmup + args.steps
    tokens = torch.randint(0, args.vocab, (total, args.batch, args.seq), device=device, generator=gen)
    ts, losses, norms = [], [], []
    peak_warm = reserved_warm = 0
    for k in range(total):
        if k == args.warmup and cuda:  # the timed steps' own peak from here on
            peak_warm = torch.cuda.max_memory_allocated()
            reserved_warm = torch.cuda.max_memory_reserved()
            torch.cuda.reset_peak_memory_stats()
        x = tokens[k]
        sync()
        t = time.perf_counter()
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        sync()
        ts.append(time.perf_counter() - t)
        losses.append(float(loss.item()))
        norm = engine.get_global_grad_norm()
        norms.append(None if norm is None else float(norm))
        print(json.dumps({"step": k, "s": ts[-1], "loss": losses[-1], "grad_norm": norms[-1]}), flush=True)

    timed = ts[args.warmup :]
    step_s = float(np.median(timed))
    tokens_per_step = args.batch * args.seq
    peak_timed = torch.cuda.max_memory_allocated() if cuda else 0
    reserved_timed = torch.cuda.max_memory_reserved() if cuda else 0
    rss_peak, rss_now = host_memory_gib()
    del hf_zero3
    return {
        "case": case,
        "params": n,
        "params_formula": expected,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "versions": {
            "deepspeed": deepspeed.__version__,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "transformers": transformers.__version__,
            "pydantic": pydantic.VERSION,
            "python": sys.version.split()[0],
        },
        "cpus": os.cpu_count(),
        "shape": {k: getattr(args, k) for k in ("shape", *SHAPES["llama"], "batch", "seq")},
        "ds_config": config,
        "zero_stage": engine.zero_optimization_stage(),
        "optimizer": f"{type(engine.optimizer).__name__}/{type(inner).__name__}",
        "build_s": build_s,
        "init_s": init_s,
        "first_step_s": ts[0],
        "step_s": step_s,
        "mean_step_s": float(np.mean(timed)),
        "step_times": ts,
        "tokens_per_s": tokens_per_step / step_s,
        "tflops_8N": 8 * (n - inactive_experts(args)) * tokens_per_step / step_s / 1e12,
        "gpu_after_build_gib": after_build,
        "gpu_peak_gib": max(peak_warm, peak_timed) / 2**30,
        "gpu_reserved_gib": max(reserved_warm, reserved_timed) / 2**30,
        "gpu_peak_timed_gib": peak_timed / 2**30,
        "host_rss_gib": rss_peak,
        "host_rss_end_gib": rss_now,
        "losses": losses,
        "grad_norms": norms,
    }


SHAPE_FLAGS = tuple(SHAPES["llama"])


def _child_argv(args: argparse.Namespace, case: str) -> list[str]:
    """A DeepSpeed case's process: this script with `--case`, every flag resolved."""
    argv = [f"--case={case}", f"--shape={args.shape}"]
    for k in (*SHAPE_FLAGS, "batch", "seq", "warmup", "steps", "out"):
        argv.append(f"--{k}={getattr(args, k)}")
    argv += [f"--ds={item}" for item in args.ds]
    return argv


def _jaxzero_argv(args: argparse.Namespace, case: str) -> list[str]:
    """A jaxzero case's process: `bench_offload.py`'s step case at the same shape and tokens."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_offload.py")
    step_case, own = JAXZERO_CASES[case]
    argv = [script, f"--case={step_case}", f"--model={JAXZERO_BASE[args.shape]}"]
    argv += [f"--batch={args.batch}", f"--seq={args.seq}", f"--warmup={args.warmup}", f"--steps={args.steps}"]
    over = {**jaxzero_overrides(args), **own}
    argv += [f"--out={args.out}", *(f"--set={k}={v}" for k, v in over.items())]
    return argv


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked, with the shape's defaults filled in (`resolve_shape`); `cases` a list."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    every = [*CASES, *JAXZERO_CASES]
    ap.add_argument("--cases", default="", help=f"comma list of: {', '.join(every)} (default: the shape's)")
    ap.add_argument("--case", default="", help=argparse.SUPPRESS)  # child process: run one case
    ap.add_argument("--shape", default="llama", choices=sorted(SHAPES), help="the model's family and shape")
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--mlp", type=int, help="MLP intermediate size (each expert's, with experts)")
    ap.add_argument("--heads", type=int, help="attention heads")
    ap.add_argument("--kv_heads", type=int, help="key/value heads (0: as many as heads)")
    ap.add_argument("--head_dim", type=int, help="width of each head (0: hidden / heads)")
    ap.add_argument("--experts", type=int, help="experts per layer (0: a dense MLP)")
    ap.add_argument("--top_k", type=int, help="experts per token")
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--batch", type=int, default=8, help="sequences per step (one micro-batch)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    ap.add_argument("--steps", type=int, default=10, help="timed steps")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder of the logs and the JSON")
    ap.add_argument(
        "--ds",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="DeepSpeed config override, applied to every case, e.g. zero_optimization.overlap_comm=false",
    )
    ap.add_argument("--timeout", type=float, default=0, help="seconds per case before it is killed (0: none)")
    args = resolve_shape(ap.parse_args(argv))
    if args.hidden % args.heads or args.heads % args.kv_heads:
        ap.error(
            f"--hidden={args.hidden} must be a multiple of --heads={args.heads}, and --heads of "
            f"--kv_heads={args.kv_heads}"
        )
    moe = args.shape == "qwen3-moe"
    if moe != bool(args.experts) or (moe and not 0 < args.top_k <= args.experts):
        ap.error(
            f"--shape={args.shape} --experts={args.experts} --top_k={args.top_k}: the qwen3-moe shape has "
            "experts (0 < top_k <= experts), the llama shape none"
        )
    if args.steps < 1 or args.warmup < 0:
        ap.error(f"--steps={args.steps} must be at least 1 and --warmup={args.warmup} at least 0")
    for item in args.ds:  # a malformed override fails here, not in every child
        try:
            set_dotted({}, item)
        except ValueError as e:
            ap.error(str(e))
    args.cases = [c for c in (args.cases or DEFAULT_CASES[args.shape]).split(",") if c]
    unknown = [c for c in args.cases if c not in every]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; the cases are {', '.join(every)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.case:
        result = run_case(args.case, args)
        print("RESULT " + json.dumps(result), flush=True)
        return
    names = args.cases
    if any(c in CASES for c in names) and importlib.util.find_spec("deepspeed") is None:
        sys.exit(
            "deepspeed is not importable by this Python. On a box without network access install it "
            "from the repository's .whl folder: python3 -m pip install -q --no-index --no-deps "
            "--no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && "
            "export PYTHONPATH=/tmp/site:$PYTHONPATH"
        )
    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ)
    for k, v in NO_MULTICAST.items():
        env.setdefault(k, v)
    env.setdefault("TORCH_EXTENSIONS_DIR", DEFAULT_EXTENSIONS_DIR)
    env.setdefault("PYTHONUNBUFFERED", "1")
    # jaxzero's cases import the repository's package
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH", "")) if p)
    print(f"TORCH_EXTENSIONS_DIR={env['TORCH_EXTENSIONS_DIR']}", flush=True)
    results = []
    for k, case in enumerate(names):
        if case in JAXZERO_CASES:
            cmd = [sys.executable, *_jaxzero_argv(args, case)]
        else:
            cmd = [sys.executable, os.path.abspath(__file__), *_child_argv(args, case)]
        repeat = f"-{k}" if names.count(case) > 1 else ""  # a case named twice keeps both logs
        log = os.path.join(args.out, f"bench_ds_{case}{repeat}.log")
        t = time.perf_counter()
        with open(log, "w") as f:  # the child writes its log as it goes: a hung case still leaves one
            try:
                rc = subprocess.run(
                    cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=args.timeout or None
                ).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        with open(log) as f:
            text = f.read()
        lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
        if rc or not lines:
            print(
                f"{case}: FAILED rc={rc} ({time.perf_counter() - t:.0f}s), log {log}; tail:\n{text[-2500:]}"
            )
            continue
        results.append({**json.loads(lines[-1][7:]), "case": case})
        print(f"{case}: done in {time.perf_counter() - t:.0f}s", flush=True)
    with open(os.path.join(args.out, f"bench_ds_{'_'.join(names)}.json"), "w") as f:
        json.dump(results, f, indent=1)
    print_table(results, args)


def print_table(results: list[dict], args: argparse.Namespace) -> None:
    """The cases side by side; "vs resident" is DeepSpeed resident's s/step over the case's, "vs ZeRO-3"
    DeepSpeed zero3-offload's (1.00x: as fast)."""
    if not results:
        return
    hd = args.head_dim or args.hidden // args.heads
    experts = (
        f", {args.experts} experts of {args.mlp}, top-{args.top_k}" if args.experts else f", MLP {args.mlp}"
    )
    print(
        f"\n{args.shape}: hidden {args.hidden}, {args.layers} layers, {args.heads} heads / "
        f"{args.kv_heads} KV heads of {hd}{experts}, vocab {args.vocab}: "
        f"{shape_param_count(args) / 1e9:.2f}B params ({shape_param_count(args):,}); "
        f"{args.batch} x {args.seq} = {args.batch * args.seq} tokens/step; {results[0]['device']}"
    )
    ds = next((r for r in results if "versions" in r), None)
    if ds:
        v = ds["versions"]
        print(
            f"DeepSpeed {v['deepspeed']}, torch {v['torch']} (CUDA {v['cuda']}), transformers "
            f"{v['transformers']}, Python {v['python']}; {ds['cpus']} CPUs"
        )
    steps = {r["case"]: r["step_s"] for r in results}
    print(
        f"{'case':14} {'s/step':>7} {'mean':>7} {'tok/s':>8} {'TFLOP/s(8N)':>11} {'GPU GiB':>8} "
        f"{'RSS GiB':>8} {'vs resident':>11} {'vs ZeRO-3':>9} {'loss':>7}"
    )
    for r in results:
        ratios = [
            f"{steps[ref] / r['step_s']:.2f}x" if ref in steps else "-"
            for ref in ("resident", "zero3-offload")
        ]
        print(
            f"{r['case']:14} {r['step_s']:7.3f} {r['mean_step_s']:7.3f} {r['tokens_per_s']:8.0f} "
            f"{r['tflops_8N']:11.1f} {r['gpu_peak_gib']:8.1f} {r['host_rss_gib']:8.1f} {ratios[0]:>11} "
            f"{ratios[1]:>9} {r['losses'][-1]:7.3f}"
        )
    for r in results:
        if "ds_config" in r:
            zero = r["ds_config"]["zero_optimization"]
            print(
                f"{r['case']:14} {r['optimizer']}; init {r['init_s']:.1f}s (build {r['build_s']:.1f}s); "
                f"zero_optimization {json.dumps(zero)}"
            )
        else:
            print(
                f"{r['case']:14} {r['plan']}; plan {r['plan_step_s']:.3f} s/step, GPU "
                f"{r['plan_gpu_gib']:.1f} GiB, host {r['plan_host_gib']:.1f} GiB; init {r['init_s']:.1f}s"
            )


if __name__ == "__main__":
    main()

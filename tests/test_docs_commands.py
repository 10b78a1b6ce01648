"""Every command the docs show runs: each `python -m jaxzero.<program> ...` (or `jaxzero-<program>`) in
a shell block of README.md and docs/*.md is run here on the CPU, in a scratch directory, in its doc's
order (a run, then its export), or, where it would train a 7B model or needs several hosts, is listed
below with the reason (the train commands among them are still parsed and validated exactly as
written, so a refused flag or combination is caught).

The commands are found by bash itself: each block runs with `python`, `srun`, `mpirun` and the
console scripts as shell functions that record their arguments, so loops, variables and line
continuations expand as they would for the reader. Placeholders become scratch paths: `hf:` and
`path/to/` checkpoints are tiny random models that transformers saves, `DIR` a prepared token
directory. A command run small keeps every flag the doc wrote and gets its shrinking overrides
after them (the last of a repeated key wins). A command that is neither run nor listed fails
`test_every_doc_command_is_run_or_listed`, so a new one cannot go untested."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from subprocess_run import user_env

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SCRIPTS = ["train", "launch", "plan", "prepare", "plot", "export", "generate", "eval"]

# Train commands run small: a few steps of short sequences.
SMALL = "--data.seq_len=32 --data.batch_size=2 --logging.progress=false"

# `doc: command` (the command as bash expanded it) -> the overrides appended to run it small.
RUN: dict[str, str] = {
    "README.md: python -m jaxzero.train": f"--steps=2 {SMALL}",
    "README.md: python -m jaxzero.train --config=configs/tiny-offload.toml": f"--steps=2 {SMALL}",
    "README.md: python -m jaxzero.prepare '--input=corpus/*.jsonl' --input=notes.txt --out=data/mine "
    "--tokenizer=path/to/Llama-3.1-8B --val_docs=1000": "",
    "README.md: python -m jaxzero.train --model.name=hf:path/to/Llama-3.1-8B --data.source=tokens "
    "--data.path=data/mine --data.seq_len=2048 --steps=1000 --checkpoint.every=100 --run_dir=runs/mine": (
        f"--steps=2 --checkpoint.every=1 {SMALL}"
    ),
    "README.md: python -m jaxzero.train --run_dir=runs/mine --steps=2000": "--steps=3",
    "README.md: python -m jaxzero.export --run_dir=runs/mine --out=export/mine-hf": "",
    "README.md: python -m jaxzero.generate --run_dir=runs/mine '--prompt=Once upon a time' "
    "--max_new_tokens=80": "--max_new_tokens=4",
    "README.md: python -m jaxzero.generate --hf=export/mine-hf --tokenizer=path/to/Llama-3.1-8B "
    "'--prompt=Once upon a time'": "--max_new_tokens=4",
    "README.md: python -m jaxzero.eval --run_dir=runs/mine --data.path=data/mine": "",
    "README.md: python -m jaxzero.train --model.name=hf:/models/Llama-3.1-8B --finetune.method=lora "
    "--data.path=data/mytext --data.batch_size=16 --data.seq_len=2048 --steps=300 --run_dir=runs/lora8b": (
        f"--steps=2 {SMALL}"
    ),
    "README.md: python -m jaxzero.export --run_dir=runs/lora8b --out=adapter8b": "",
    "README.md: python -m jaxzero.train --model.name=hf:/models/Llama-3.1-70B --finetune.method=lora "
    "--finetune.base_dtype=int8 --data.path=data/mytext --data.batch_size=16 --data.seq_len=2048 "
    "--steps=300 --run_dir=runs/lora70b": f"--steps=2 {SMALL}",
    "docs/data.md: python -m jaxzero.prepare --sft --input=chats.jsonl --out=data/chats "
    "--tokenizer=path/to/Qwen2.5-7B-Instruct": "",
    "docs/data.md: python -m jaxzero.train --model.name=hf:path/to/Qwen2.5-7B-Instruct --data.source=tokens "
    "--data.path=data/chats --data.seq_len=2048": f"--steps=2 {SMALL}",
    "docs/faults.md: python -m jaxzero.train --run_dir=runs/x --steps=1000 --checkpoint.every=100": (
        f"--steps=2 --checkpoint.every=1 {SMALL}"
    ),
    "docs/faults.md: python -m jaxzero.train --run_dir=runs/x --steps=2000": "--steps=3",
    "docs/lora.md: python -m jaxzero.export --run_dir=runs/lora8b --out=merged8b --merge": "",
    "docs/how-big.md: python -m jaxzero.train --model.name=hf:/models/Qwen3-30B-A3B --finetune.method=lora "
    "--finetune.base_dtype=int8 --finetune.lora_targets=q,k,v,o --data.path=data/mytext --data.batch_size=8 "
    "--data.seq_len=2048 --optimizer.lr=1e-4 --steps=300 --checkpoint.every=100 --run_dir=runs/lora-moe": (
        f"--steps=2 --checkpoint.every=1 {SMALL}"
    ),
    "docs/how-big.md: python -m jaxzero.export --run_dir=runs/lora-moe --out=adapter-moe": "",
    "docs/models.md: python -m jaxzero.export --run_dir=runs/x --out=export/x-hf": "",
    "docs/models.md: python -m jaxzero.export --run_dir=runs/x --out=export/x-orbax --format=orbax": "",
    "docs/models.md: python -m jaxzero.export --run_dir=runs/x --out=export/x-hf --step=500 --overwrite": (
        "--step=2"
    ),
    "docs/models.md: python -m jaxzero.train --model.name=hf:path/to/hf-checkpoint --steps=500": (
        f"--steps=2 {SMALL}"
    ),
    "docs/models.md: python -m jaxzero.train --model.name=orbax:export/x-orbax --steps=500": "--steps=2",
    "docs/models.md: python -m jaxzero.generate --run_dir=runs/x '--prompt=def fib(n):' "
    "--max_new_tokens=80": ("--max_new_tokens=4"),
    "docs/models.md: python -m jaxzero.generate --run_dir=runs/x '--prompt=import ' --temperature=0.8 "
    "--top_p=0.95 --seed=1": "--max_new_tokens=4",
    "docs/models.md: python -m jaxzero.generate --hf=path/to/Qwen2.5-0.5B "
    "'--prompt=The capital of France is'": ("--max_new_tokens=4"),
    "docs/multi-gpu.md: python -m jaxzero.launch --nproc=2 --cpu_devices_per_proc=2 -- --steps=50": (
        f"--steps=2 {SMALL} --data.batch_size=4 --run_dir=runs/launched"
    ),
    "docs/watching.md: python -m jaxzero.plot runs/offloaded runs/resident --out=figures": "",
}

# `doc: command` -> why it is not run. Train and launch commands here are parsed and validated as
# written (`parse_args`, as train does before any work).
NOT_RUN: dict[str, str] = {
    "README.md: python -m jaxzero.train --config=configs/llama-3.4b-offload.toml": "3.37B parameters",
    "README.md: python -m jaxzero.train --model.name=llama-7b --data.source=tokens --data.path=DIR "
    "--data.seq_len=2048 --data.batch_size=8 --offload.optimizer=cpu --offload.params=cpu": "a 7B model",
    "README.md: python -m jaxzero.train --data.batch_size=64 --run_dir=runs/x": (
        "docs/faults.md trains the same default model into runs/x"
    ),
    "README.md: python -m jaxzero.launch --nproc=8 -- --data.batch_size=64 --run_dir=runs/x": (
        "8 processes of 1 GPU each; docs/multi-gpu.md launches 2 on the CPU"
    ),
    "README.md: python -m jaxzero.train '[--config=PATH]' '[--deepspeed=ds_config.json]' "
    "'[--section.key=value' '...]'": "the synopsis of the arguments, not a command",
    "docs/data.md: python -m jaxzero.prepare '--input=corpus/*.jsonl' --input=notes.txt --out=data/mine "
    "--tokenizer=path/to/Llama-3.1-8B --val_docs=1000": "the README's step 1, which runs",
    "docs/data.md: python -m jaxzero.train --model.name=hf:path/to/Llama-3.1-8B --data.source=tokens "
    "--data.path=data/mine --data.seq_len=2048": "the README's step 2 without its run flags, which runs",
    "docs/deepspeed.md: python -m jaxzero.train --deepspeed=ds_config.json --model.name=llama-7b "
    "--data.source=tokens --data.path=data/mine": "a 7B model (tests/test_deepspeed.py runs the files)",
    "docs/lora.md: python -m jaxzero.train --model.name=hf:/models/Llama-3.1-8B --finetune.method=lora "
    "--finetune.lora_rank=16 --finetune.lora_alpha=32 --data.path=data/mytext --data.batch_size=16 "
    "--data.seq_len=2048 --optimizer.lr=2e-4 --steps=300 --run_dir=runs/lora8b": (
        "the README's LoRA run with the rank, alpha and lr spelled out; the README's runs"
    ),
    "docs/lora.md: python -m jaxzero.export --run_dir=runs/lora8b --out=adapter8b": (
        "the README's, which runs"
    ),
    "docs/lora.md: python -m jaxzero.train --model.name=hf:/models/Llama-3.1-70B --finetune.method=lora "
    "--finetune.base_dtype=int8 --data.path=data/mytext --data.batch_size=16 --data.seq_len=2048 "
    "--optimizer.lr=1e-4 --steps=300 --run_dir=runs/lora70b": "the README's int8 LoRA run, which runs",
    "docs/multi-gpu.md: python -m jaxzero.train --data.batch_size=64 --run_dir=runs/x": (
        "docs/faults.md trains the same default model into runs/x"
    ),
    "docs/multi-gpu.md: python -m jaxzero.launch --nproc=8 -- --data.batch_size=64 --run_dir=runs/x": (
        "8 processes of 1 GPU each; the CPU launch below runs"
    ),
    "docs/multi-gpu.md: python -m jaxzero.launch --nproc=2 -- --model.name=llama-13b "
    "--optimizer.state_dtype=bfloat16 --data.source=tokens --data.path=DIR --data.seq_len=2048 "
    "--data.batch_size=32 --run_dir=runs/13b": "a 13B model on 2 GPUs",
    "docs/multi-gpu.md: JAX_COORDINATOR_ADDRESS=host0:12345 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=0 "
    "python -m jaxzero.train --run_dir=/shared/x": "two hosts (tests/test_multiprocess.py runs processes)",
    "docs/multi-gpu.md: JAX_COORDINATOR_ADDRESS=host0:12345 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=1 "
    "python -m jaxzero.train --run_dir=/shared/x": "two hosts (tests/test_multiprocess.py runs processes)",
    "docs/multi-gpu.md: srun --nodes=2 --ntasks-per-node=8 --gpus-per-node=8 python -m jaxzero.train "
    "--run_dir=/shared/x": "SLURM",
    "docs/multi-gpu.md: JAX_LOCAL_DEVICE_IDS=0,1,2,3,4,5,6,7 srun --nodes=2 --ntasks-per-node=1 "
    "python -m jaxzero.train --run_dir=/shared/x": "SLURM",
    "docs/multi-gpu.md: mpirun -np 16 -x JAX_COORDINATOR_ADDRESS=host0:12345 python -m jaxzero.train "
    "--run_dir=/shared/x": "Open MPI",
    "docs/watching.md: python -m jaxzero.train --run_dir=runs/x --offload.optimizer=cpu --offload.params=cpu "
    "--profile.steps=10:13": "13 steps of profiling (tests/test_profiling.py profiles)",
}

# What the docs' placeholders name, in the scratch directory.
PLACEHOLDERS = [
    (r"=DIR$", "=data/fixture"),  # --data.path=DIR: token files
    (r"=hf:/models/", "=hf:models/"),
    (r"^runs/offloaded$", "runs/x"),  # the plot's two runs: docs/faults.md's and the CPU launch's
    (r"^runs/resident$", "runs/launched"),
]

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
WORDS = "once upon a time the fox def fib n import capital of france is hello there be brief".split()


@dataclass(frozen=True)
class Command:
    doc: str  # README.md, docs/x.md
    env: tuple[str, ...]  # VAR=value before the command
    argv: tuple[str, ...]  # as bash expanded it: python -m jaxzero.x ..., srun ..., jaxzero-x ...

    @property
    def key(self) -> str:
        return f"{self.doc}: {' '.join([*self.env, shlex.join(self.argv)])}"

    @property
    def program(self) -> str:
        """train, plan, ...: the jaxzero program it runs (inside a launcher's arguments too)."""
        for i, a in enumerate(self.argv):
            if a == "-m" and self.argv[i + 1].startswith("jaxzero."):
                return self.argv[i + 1].removeprefix("jaxzero.")
            if a.startswith("jaxzero-"):
                return a.removeprefix("jaxzero-")
        raise AssertionError(f"no jaxzero program in {self.key}")

    @property
    def args(self) -> list[str]:
        """The program's arguments, placeholders mapped to the scratch directory's paths."""
        i = next(i for i, a in enumerate(self.argv) if a.startswith(("jaxzero.", "jaxzero-")))
        out = []
        for arg in self.argv[i + 1 :]:
            for pattern, repl in PLACEHOLDERS:
                arg = re.sub(pattern, repl, arg)
            out.append(arg)
        return out


_SHIMS = r"""
_rec() { { env | grep -E '^JAX_' | sort | tr '\n' '\0'; printf '%s\0' "$@"; printf '\036\0'; } >> "$REC"; }
python() { case "$*" in "-m jaxzero."*) _rec python "$@";; esac; }
srun() { case "$*" in *jaxzero*) _rec srun "$@";; esac; }
mpirun() { case "$*" in *jaxzero*) _rec mpirun "$@";; esac; }
python3() { :; }; pip() { :; }; tensorboard() { :; }
""" + "".join(f'jaxzero-{s}() {{ _rec jaxzero-{s} "$@"; }}\n' for s in SCRIPTS)


def shell_blocks(doc: Path) -> list[str]:
    """The fenced shell blocks of `doc` that name a jaxzero program (transcripts, `$ ` first, left out)."""
    blocks = re.findall(r"^```(\w*)\n(.*?)^```", doc.read_text(), re.S | re.M)
    return [
        body
        for lang, body in blocks
        if lang in ("", "bash", "sh", "shell")
        and not body.startswith("$ ")
        and re.search(r"python -m jaxzero\.|jaxzero-\w", body)
    ]


def doc_commands(scratch: Path) -> list[Command]:
    """Every jaxzero command of the docs' shell blocks, in doc order, as bash expands them."""
    (scratch / ".venv" / "bin").mkdir(parents=True, exist_ok=True)
    (scratch / ".venv" / "bin" / "activate").write_text("")  # the README's install line goes on
    commands = []
    for doc in DOCS:
        name = str(doc.relative_to(REPO))
        for block in shell_blocks(doc):
            rec = scratch / "rec"
            rec.write_bytes(b"")
            env = {"PATH": os.environ["PATH"], "REC": str(rec)}
            subprocess.run(
                ["bash", "-c", _SHIMS + block], cwd=scratch, env=env, capture_output=True, timeout=60
            )
            for record in rec.read_bytes().split(b"\x1e\x00")[:-1]:
                fields = [f.decode() for f in record.split(b"\x00")[:-1]]
                k = next(i for i, f in enumerate(fields) if not re.match(r"JAX_\w+=", f))
                commands.append(Command(name, tuple(fields[:k]), tuple(fields[k:])))
    return commands


def test_every_doc_command_is_run_or_listed(tmp_path):
    """A command in the docs is run here (`RUN`, or any `plan`), or listed with its reason (`NOT_RUN`);
    the lists name only commands the docs hold."""
    commands = doc_commands(tmp_path)
    keys = {c.key for c in commands}
    assert len(commands) > 50, "the docs' commands were not found: " + "\n".join(sorted(keys))
    unlisted = [c.key for c in commands if c.program != "plan" and c.key not in RUN and c.key not in NOT_RUN]
    assert not unlisted, "commands the docs show, neither run nor listed with a reason:\n" + "\n".join(
        unlisted
    )
    stale = sorted((RUN.keys() | NOT_RUN.keys()) - keys)
    assert not stale, "listed commands the docs no longer show:\n" + "\n".join(stale)
    assert not RUN.keys() & NOT_RUN.keys()
    chained = {doc for docs in CHAINS.values() for doc in docs}
    assert {c.doc for c in commands} <= chained, "a doc with commands is in no CHAINS entry: never run"


# The docs whose commands share one scratch directory, in this order: a later doc uses an earlier
# one's runs (docs/lora.md merges the README's LoRA run; docs/models.md exports docs/faults.md's).
# Chains that share nothing are apart, so that the suite's workers run them side by side.
CHAINS = {
    "readme-data-lora": ["README.md", "docs/data.md", "docs/lora.md"],
    "runs-x": [
        "docs/faults.md",
        "docs/models.md",
        "docs/multi-gpu.md",
        "docs/watching.md",
        "docs/deepspeed.md",
    ],
    "how-big": ["docs/how-big.md", "docs/architecture.md", "docs/library.md"],
}
SYNOPSIS = "the synopsis of the arguments, not a command"


def _tokenizer(root: Path, corpus: list[str], chat: bool) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["<unk>", "<eot>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=specials))
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    config = {"eos_token": "<eot>", **({"chat_template": CHATML} if chat else {})}
    (root / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def scratch_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    return build_scratch(tmp_path_factory.mktemp("docs-scratch"))


def build_scratch(root: Path) -> Path:
    """What the docs' commands expect to find in `root`: corpus files, tiny random checkpoints (with
    tokenizers) where the docs name Llama, Qwen or Qwen3-MoE checkpoints, token files for `DIR` and
    `data/mytext`, a DeepSpeed file, the presets."""
    import torch
    import transformers

    from jaxzero.cli.prepare import prepare

    shutil.copytree(REPO / "configs", root / "configs")
    shutil.copy(REPO / "tests" / "deepspeed_configs" / "zero_offload.json", root / "ds_config.json")
    lines = [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(8 + i % 9)) for i in range(1100)]
    (root / "corpus").mkdir()
    for part, docs in (("a", lines[:600]), ("b", lines[600:])):
        (root / "corpus" / f"{part}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (root / "notes.txt").write_text(" ".join(lines[:20]))
    chats = [
        {"messages": [{"role": "user", "content": a}, {"role": "assistant", "content": b}]}
        for a, b in zip(lines[:40], lines[40:80])
    ]
    (root / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    shape = dict(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))
    qwen = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**shape))
    moe = transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(
            **shape, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16
        )
    )
    for name, model in [
        ("models/Qwen3-30B-A3B", moe),
        ("path/to/Llama-3.1-8B", llama),
        ("path/to/hf-checkpoint", llama),
        ("models/Llama-3.1-8B", llama),
        ("models/Llama-3.1-70B", llama),
        ("path/to/Qwen2.5-7B-Instruct", qwen),
        ("path/to/Qwen2.5-0.5B", qwen),
    ]:
        model.save_pretrained(root / name)
        _tokenizer(root / name, lines, chat="Qwen" in name)
    inputs = [str(root / "corpus" / "*.jsonl")]
    prepare(
        inputs,
        root / "data" / "mytext",
        tokenizer=str(root / "path/to/Llama-3.1-8B"),
        workers=1,
        progress=False,
    )
    shutil.copytree(root / "data" / "mytext", root / "data" / "fixture")
    (root / ".venv" / "bin").mkdir(parents=True)
    (root / ".venv" / "bin" / "activate").write_text("")
    return root


def _check_as_written(cmd: Command) -> None:
    """Parse and validate a train or launch command's training arguments as train does, before any work."""
    from jaxzero.overrides import parse_args

    args = cmd.args
    if cmd.program == "launch":
        args = args[args.index("--") + 1 :]
    parse_args(args)


def run_chain(chain: str, scratch: Path, stop: bool = True) -> list[tuple[str, float, str]]:
    """Run `chain`'s commands in `scratch` (the working directory): (command, seconds, error or "")
    each; with `stop`, up to the first error."""
    from jaxzero.cli import plan
    from jaxzero.overrides import parse_args

    commands = [c for c in doc_commands(scratch.parent / "find") if c.doc in CHAINS[chain]]
    commands.sort(key=lambda c: CHAINS[chain].index(c.doc))  # stable: each doc's own order kept
    results = []
    for cmd in commands:
        start, error = time.monotonic(), ""
        try:
            if cmd.program == "plan":
                parse_args(cmd.args)  # the flags as written: refused ones fail here
                code = plan.main(cmd.args)
                # how-big.md's loop tabulates what fits and what is refused; the others plan to fit
                error = f"exit {code}" if code and not (code == 2 and cmd.doc == "docs/how-big.md") else ""
            elif cmd.key in NOT_RUN:
                if cmd.program in ("train", "launch") and NOT_RUN[cmd.key] != SYNOPSIS:
                    _check_as_written(cmd)
            else:
                extra = shlex.split(RUN[cmd.key])
                argv = [sys.executable, "-m", f"jaxzero.{cmd.program}", *cmd.args, *extra]
                done = subprocess.run(
                    argv, cwd=scratch, env=user_env(), capture_output=True, text=True, timeout=600
                )
                if done.returncode:
                    error = f"(+ {RUN[cmd.key]!r}): exit {done.returncode}\n{done.stderr}"
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        results.append((cmd.key, time.monotonic() - start, error))
        if error and stop:
            break
    return results


@pytest.mark.slow  # programs run in subprocesses, ~15 per chain
@pytest.mark.timeout(900)
@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_the_docs_commands_run(chain, scratch_template, tmp_path, monkeypatch):
    """Each doc's commands in order in one scratch directory: run (exit 0) where `RUN` lists them, with
    its shrinking overrides after the doc's flags; `plan` run in this process as written; the rest
    parsed and validated as written."""
    scratch = tmp_path / "scratch"
    shutil.copytree(scratch_template, scratch)
    monkeypatch.chdir(scratch)
    results = run_chain(chain, scratch)
    failed = [f"{key}: {error}" for key, _, error in results if error]
    assert not failed, failed[0]
    assert sum(key in RUN for key, _, _ in results) >= (2 if chain == "how-big" else 8)

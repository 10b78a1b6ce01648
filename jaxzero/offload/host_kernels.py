"""Fused optimizer updates in host RAM: one pass over memory per parameter.

XLA:CPU compiles an optax update into several loop fusions (new first moment, new second moment, new
parameter, compute-dtype copy), each a full pass over memory: ~42 bytes per parameter for AdamW. The
update is memory-bound, so the kernels here read each parameter, gradient and moment once and write
each result once (28 bytes per parameter for AdamW with float32 moments, 20 with bfloat16 moments), as
`torch.optim.AdamW(fused=True)` does (speeds: BENCHMARKS.md, "Host optimizer throughput, jaxzero vs
torch's fused CPU AdamW"). They are compiled by numba (a wheel; no compiler at install time) and run
on chunks of ~1M parameters from a pool of threads, without the GIL.

They reproduce optax's arithmetic in float32 and in optax's order of operations, for the optimizers
`jaxzero.numerics.optim.build_optimizer` builds (AdamW/Adam, Lion, SGD with or without momentum; moments in
float32 or bfloat16; `jaxzero.plan.FUSED_OPTIMIZERS`). They are tested against optax's own update
(tests/test_host_kernels.py). Any other transformation keeps running as optax on XLA:CPU.

Each kernel comes in three passes over the same arithmetic (`Pass`): the whole update in place,
and the two halves of a two-pass update, which writes the new compute-dtype weights first and
masters and moments later, bit for bit the one-pass result (`jaxzero.offload.pipeline`).

The kernels update the host arrays *in place*: they write through a NumPy view of the CPU backend's
buffer (`writable_view`), and write the compute-dtype weights likewise into `pinned_host` buffers.
This stands in for buffer donation: the step consumes its input state either way, and nothing else
reads these buffers while a step runs.

bfloat16 is handled as its 16 bits (uint16): widening is a shift, narrowing rounds to nearest even as
XLA's convert does.

Run to run the same bits, whatever the schedule: every kernel is elementwise (no reduction, no
atomics), each element's result a function of that element's inputs and of scalars fixed before the
unit's update starts (the gradient multiplier from the global norm, the learning rate, the bias
corrections). So how a unit is cut into chunks, how many threads run them and in which order they
finish change nothing (tests/test_determinism.py); `--determinism` changes nothing here.
"""

from __future__ import annotations

import ctypes
import enum
import hashlib
import importlib.util
import itertools
import os
import re
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import jax
import jax.numpy as jnp
import numba
import numba.extending
import numpy as np
from llvmlite import ir
from numba.core import cgutils

from jaxzero.config import OptimizerConfig
from jaxzero.plan import FUSED_OPTIMIZERS

CHUNK = 1 << 22  # parameters per kernel call: few calls (each holds the GIL briefly), still balanced

_F32_ONE = np.float32(1.0)

# -- kernels ----------------------------------------------------------------------------------------


@numba.extending.intrinsic
def prefetch(typingctx, array, index):
    """Request the cache line of `array[index]` into L2 (LLVM's `prefetch`: a hint, which changes no
    result). Used by the generated kernels, which pass only indices within the array."""
    if not isinstance(array, numba.types.Array):
        return None

    def codegen(context, builder, signature, args):
        array_type = signature.args[0]
        view = context.make_array(array_type)(context, builder, args[0])
        at = cgutils.get_item_pointer(context, builder, array_type, view, [args[1]], wraparound=False)
        at = builder.bitcast(at, ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        name = "llvm.prefetch.p0" if str(at.type) == "ptr" else "llvm.prefetch.p0i8"  # opaque pointers or not
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [at.type, i32, i32, i32]), name
        )
        builder.call(fn, [at, i32(0), i32(2), i32(1)])  # read, locality 2 (L2), data cache
        return context.get_dummy_value()

    return numba.types.void(array, index), codegen


# One kernel per (optimizer, gradient dtype, moment dtype, weight dtype), generated from the update
# rule below as flat loops that LLVM vectorises: bfloat16 inputs are first widened into float32
# scratch (a shift of the bits), the update runs in float32 with optax's order of operations, and
# results are narrowed back (round to nearest even; a NaN stays a quiet NaN), a tile of elements at a
# time so that the scratch stays in cache and memory is still read and written once.
# Scalars arrive as float32 so that every operation stays in float32, as in XLA.

_RULES = {  # optimizer -> (moment names, scalar names, update of element j)
    "adam": (
        ("m", "v"),
        ("b1", "b2", "eps", "bc1", "bc2"),
        """
        gj = gf[j] * gmul
        mj = (one - b1) * gj + b1 * mf[j]
        vj = (one - b2) * (gj * gj) + b2 * vf[j]
        pj = p[j]
        u = (mj / bc1) / (np.sqrt(vj / bc2) + eps) + wd * pj
        p[j] = pj + u * neg_lr
        mf[j] = mj
        vf[j] = vj""",
    ),
    "lion": (
        ("m",),
        ("b1", "b2"),
        """
        gj = gf[j] * gmul
        mj = mf[j]
        pj = p[j]
        u = np.sign((one - b1) * gj + b1 * mj) + wd * pj
        p[j] = pj + u * neg_lr
        mf[j] = (one - b2) * gj + b2 * mj""",
    ),
    "sgd_momentum": (
        ("t",),
        ("momentum",),
        """
        pj = p[j]
        tj = (gf[j] * gmul + wd * pj) + momentum * tf[j]
        p[j] = pj + tj * neg_lr
        tf[j] = tj""",
    ),
    "sgd": (
        (),
        (),
        """
        pj = p[j]
        p[j] = pj + (gf[j] * gmul + wd * pj) * neg_lr""",
    ),
}

_WIDEN = """
    {x}u = scratch[{k} * n : ({k} + 1) * n]
    for j in range(n):
        {x}u[j] = np.uint32({src}[j]) << np.uint32(16)
    {x}f = {x}u.view(np.float32)"""

_NARROW = """
    for j in range(n):
        u = {bits}[j]
        r = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
        q = (u >> np.uint32(16)) | np.uint32(0x40)
        nan = np.uint32((u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000))
        {out}[j] = np.uint16(r + nan * (q - r))"""

# How a kernel walks a chunk, by whether its moments are bfloat16: (tile, prefetch). A tile is the
# elements widened into a thread's scratch at a time (in L2); with prefetch P > 0 the update runs in
# blocks of P elements, each followed by requests for the same offsets of the next tile's arrays, so
# that one core's memory traffic for the next tile overlaps its arithmetic on this one (one thread
# per core leaves nothing else to overlap them). Chosen by measurement, per moment dtype
# (BENCHMARKS.md, "The host kernels' memory phases and vector width").
LAYOUTS = {False: (1 << 16, 0), True: (1 << 14, 128)}
SCRATCH = 4 * max(tile for tile, _ in LAYOUTS.values())  # gradient, up to two moments, new parameters


class Pass(enum.StrEnum):
    """What one kernel call reads and writes (all flat, one chunk). Every pass runs the same
    arithmetic, so `WEIGHTS` then `STATE` give the bits of `FULL`."""

    FULL = "full"  # reads p, moments, g; writes p, moments (in place) and w, the compute-dtype weights
    WEIGHTS = "weights"  # reads p, moments, g; writes only w (the first pass of a two-pass update)
    STATE = "state"  # reads p, moments, g; writes p, moments in place (a two-pass update's second)


_kernels: dict[tuple, Callable[..., None]] = {}
_compile_lock = threading.Lock()
_local = threading.local()


def _scratch() -> np.ndarray:
    """This thread's scratch for widened inputs (SCRATCH uint32), allocated once per thread."""
    buf = getattr(_local, "scratch", None)
    if buf is None:
        buf = _local.scratch = np.empty(SCRATCH, np.uint32)
    return buf


def _kernel(
    name: str, g16: bool, m16: bool, w16: bool, pass_: Pass, unit: frozenset[str] = frozenset()
) -> Callable[..., None]:
    """The compiled kernel for one combination; its arguments are `_source`'s."""
    key = (name, g16, m16, w16, pass_, LAYOUTS[m16], unit)  # the layout: a benchmark may change it
    with _compile_lock:
        if key not in _kernels:
            _kernels[key] = _load(_source(name, g16, m16, w16, pass_, unit)).kernel
    return _kernels[key]


def _source(
    name: str, g16: bool, m16: bool, w16: bool, pass_: Pass, unit: frozenset[str] = frozenset()
) -> str:
    """Kernel source: `kernel(<arrays>, scratch, gmul, *scalars, neg_lr, wd)` where <arrays> is
    `p, *moments, g, w` (`full`, `weights`) or `p, *moments, g` (`state`). In place each is one
    array, one pointer, which is what lets LLVM vectorise without alias checks. Moments pass through
    float32 scratch when they are bf16 (widened). `unit` names divisors that are exactly 1 for this
    update (Adam's bias corrections `bc1`, `bc2` once b**t rounds away in float32): x / 1 is x in
    IEEE arithmetic, so their divisions are left out, which changes no bit."""
    moments, scalars, body = _RULES[name]
    for divisor in sorted(unit):
        body = re.sub(rf" / {divisor}\b", "", body)
    arrays = "".join(f"{x}, " for x in ("p", *moments)) + "g"
    arrays += ", w" * (pass_ is not Pass.STATE)
    rest = f"gmul, {''.join(x + ', ' for x in scalars)}neg_lr, wd"
    jit = "@numba.njit(nogil=True, error_model='numpy', cache=True)"
    # `tile` updates n <= the layout's tile of elements with flat loops (LLVM vectorises those);
    # `kernel` walks the chunk tile by tile so that the scratch stays in cache.
    tile_len, fetch = LAYOUTS[m16]
    # The arrays a tile reads or writes, and how many of each element fit a 64-byte line.
    per_line = {"p": 16, "g": 32 if g16 else 16, "w": 32 if w16 else 16}
    per_line.update({x: 32 if m16 else 16 for x in moments})
    fetched = [(a, per_line[a]) for a in arrays.split(", ")] if fetch else []
    src = ["import numba", "import numpy as np"]
    src += ["from jaxzero.offload.host_kernels import prefetch"] if fetch else []
    src += ["", ""]
    helpers_at = len(src)
    nxt = "".join(f", nxt_{x}" for x, _ in fetched)
    src += [jit, f"def tile({arrays}{nxt}, scratch, {rest}):"]
    src += ["    n = p.shape[0]", "    one = np.float32(1.0)"]
    src.append(_WIDEN.format(x="g", k=0, src="g") if g16 else "    gf = g")
    for k, x in enumerate(moments, start=1):  # float32 moments are read (and written) in place
        src.append(_WIDEN.format(x=x, k=k, src=x) if m16 else f"    {x}f = {x}")
    if pass_ is Pass.WEIGHTS:  # new parameters into scratch
        k = len(moments) + 1
        src.append(f"    pnu = scratch[{k} * n : ({k} + 1) * n]\n    pn = pnu.view(np.float32)")
        body = body.replace("p[j] = ", "pn[j] = ")
    if pass_ is Pass.WEIGHTS:  # moments not stored
        stores = tuple(f"{x}f[j] =" for x in moments)
        body = "\n".join(ln for ln in body.split("\n") if not ln.strip().startswith(stores))
    helpers = []
    if fetch:  # the update in blocks, each followed by requests for the next tile's lines
        used = sorted(set(re.findall(r"\b(\w+)\[j\]", body)))
        src.append(f"    for b in range(0, n, {fetch}):")
        src.append(f"        e = min(b + {fetch}, n)")
        src.append(f"        update({', '.join(f'{x}[b:e]' for x in used)}, {rest})")
        for x, step in fetched:
            src.append(f"        for q in range(b, min(e, nxt_{x}.shape[0]), {step}):")
            src.append(f"            prefetch(nxt_{x}, q)")
        helpers = [jit, f"def update({', '.join(used)}, {rest}):", "    one = np.float32(1.0)"]
        helpers += [f"    for j in range({used[0]}.shape[0]):" + body, "", ""]
    else:
        src.append("    for j in range(n):" + body)
    if pass_ is not Pass.WEIGHTS and m16:
        for x in moments:
            src.append(_NARROW.format(bits=f"{x}u", out=x))
    new_p = "pn" if pass_ is Pass.WEIGHTS else "p"
    if pass_ is not Pass.STATE:
        if w16:
            src.append(f"    pu = {new_p}.view(np.uint32)" + _NARROW.format(bits="pu", out="w"))
        else:
            src.append(f"    for j in range(n):\n        w[j] = {new_p}[j]")
    sliced = ", ".join(f"{x}[lo:hi]" for x in arrays.split(", "))
    sliced += "".join(f", {x}[hi:nh]" for x, _ in fetched)
    src[helpers_at:helpers_at] = helpers
    src += [
        "",
        "",
        jit,
        f"def kernel({arrays}, scratch, {rest}):",
        f"    for lo in range(0, p.shape[0], {tile_len}):",
        f"        hi = min(lo + {tile_len}, p.shape[0])",
        f"        nh = min(hi + {tile_len}, p.shape[0])",
        f"        tile({sliced}, scratch, {rest})",
        "",
    ]
    return "\n".join(src)


# Names what the cached kernels depend on beside their source: how this loader registers modules, and
# the code generation of the intrinsic (`prefetch`), which the source only calls. A change to either
# must change it, so that old caches are not loaded.
_CACHE_SALT = "sys.modules, prefetch 1"


def _load(source: str) -> ModuleType:
    """Import generated kernel source from a file named by its hash, so that numba's on-disk cache
    (next to the file) spares later processes the compilation (seconds per kernel)."""
    digest = hashlib.sha256((source + numba.__version__ + _CACHE_SALT).encode()).hexdigest()[:20]
    for root in (
        os.environ.get("JAXZERO_CACHE_DIR"),
        os.path.join(Path.home(), ".cache"),
        tempfile.gettempdir(),
    ):
        if not root:
            continue
        path = Path(root) / "jaxzero" / f"host_kernel_{digest}.py"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.exists():
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(source)
                tmp.replace(path)  # atomic: concurrent processes write the same text
            break
        except OSError:  # read-only home or the like: try the next place
            continue
    name = f"jaxzero_host_kernel_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # numba's cache finds the module by name when it loads a kernel
    spec.loader.exec_module(module)
    return module


def warm_up(
    rule: FusedRule,
    grad_dtype: np.dtype,
    moment_dtype: np.dtype,
    weight_dtype: np.dtype,
    passes: Sequence[Pass] = (Pass.FULL, Pass.WEIGHTS, Pass.STATE),
    counts: Sequence[int] = (0,),
) -> None:
    """Compile (or load from the cache) the kernels `rule` will use at update numbers `counts`
    (`FusedRule.kernel_counts`), one per pass, on tiny arrays."""
    n = 8
    g = np.zeros(n, bits_dtype(grad_dtype))
    g.flags.writeable = False  # gradients are read through read-only views: a distinct numba type
    for count, pass_ in itertools.product(counts, passes):
        p = np.zeros(n, np.float32)
        moments = [np.zeros(n, bits_dtype(moment_dtype)) for _ in rule.moments()]
        w = None if pass_ is Pass.STATE else np.zeros(n, bits_dtype(weight_dtype))
        rule.kernel(count, 0.0, 1.0, pass_)(p, *moments, g, w, 0.0)


# -- views -----------------------------------------------------------------------------------------


def bits_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype a kernel sees: bfloat16 as its bits."""
    return np.dtype(np.uint16) if dtype == jnp.bfloat16 else np.dtype(dtype)


def writable_view(x: jax.Array | np.ndarray) -> np.ndarray:
    """A flat, writable NumPy view of a CPU-backend array's buffer, or of a writable NumPy array
    (bfloat16 as uint16). Writes are seen by the array: the caller must own `x` and nothing may read
    it concurrently. Waits for `x` (a host sync)."""
    if isinstance(x, np.ndarray):
        if not x.flags.writeable:
            raise ValueError("writable_view of a read-only NumPy array")
        return x.reshape(-1).view(bits_dtype(x.dtype))
    # The computation that writes `x` may still run (dispatch is asynchronous): it would overwrite
    # what is written through the view. Waiting is free for an array that is ready.
    x.block_until_ready()  # host sync
    buf = (ctypes.c_byte * x.nbytes).from_address(x.unsafe_buffer_pointer())
    return np.frombuffer(buf, dtype=bits_dtype(x.dtype))


def readable_view(x: np.ndarray) -> np.ndarray:
    """A flat, read-only view of a host NumPy array (bfloat16 as uint16). Always read-only, so that
    the kernels see one numba type for gradients, whatever array they came from."""
    v = x.reshape(-1).view(bits_dtype(x.dtype))
    v.flags.writeable = False
    return v


# -- which optimizers --------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class FusedRule:
    """The fused form of `build_optimizer(cfg, clip=False, mask=...)`'s update for one unit."""

    name: str  # adamw | adam | lion | sgd
    b1: float
    b2: float
    eps: float
    weight_decay: float
    momentum: float

    @staticmethod
    def of(cfg: OptimizerConfig) -> FusedRule:
        """The rule for `cfg`, one of the optimizers the kernels implement (`FUSED_OPTIMIZERS`; the
        offload plan decides whether they run at all)."""
        if cfg.name not in FUSED_OPTIMIZERS:
            raise ValueError(f"the fused host kernels implement {FUSED_OPTIMIZERS}, not {cfg.name!r}")
        return FusedRule(
            name=cfg.name,
            b1=cfg.b1,
            b2=cfg.b2,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            momentum=cfg.momentum,
        )

    def moments(self) -> tuple[str, ...]:
        """Names of the optax state fields that hold per-parameter moments, in kernel order."""
        if self.name in ("adamw", "adam"):
            return ("mu", "nu")
        if self.name == "lion":
            return ("mu",)
        return ("trace",) if self.momentum else ()

    def _corrections(self, count: int) -> tuple[np.float32, np.float32]:
        """Adam's bias corrections (bc1, bc2) for update number `count`: optax's 1 - b**t with the
        incremented count t, in float32."""
        t = np.float32(count + 1)
        return _F32_ONE - np.float32(self.b1) ** t, _F32_ONE - np.float32(self.b2) ** t

    def exact_ones(self, count: int) -> frozenset[str]:
        """The kernel's divisors that are exactly 1 at update number `count`: Adam's bias corrections
        once b**t rounds away in float32 (b1 = 0.9: from the 165th update; b2 = 0.95: the 338th). The
        kernel leaves those divisions out (x / 1 is x in IEEE arithmetic: no bit changes), 20-46% of its
        arithmetic on the hosts measured (BENCHMARKS.md, "The host kernels' divider")."""
        if self.name not in ("adamw", "adam"):
            return frozenset()
        return frozenset(k for k, bc in zip(("bc1", "bc2"), self._corrections(count)) if bc == _F32_ONE)

    def kernel_counts(self, first: int, last: int) -> list[int]:
        """One update number in [first, last] for each kernel the updates in that range run (each
        set of `exact_ones`): what `warm_up` compiles. `exact_ones` only grows with the count."""
        counts, lo = [first], first
        while self.exact_ones(lo) != self.exact_ones(last):  # the next count whose set differs
            hi = last
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if self.exact_ones(mid) == self.exact_ones(lo) else (lo, mid)
            counts.append(lo := hi)
        return counts

    def kernel(self, count: int, lr: float, gmul: float, pass_: Pass = Pass.FULL) -> Callable[..., None]:
        """A function (p, *moments, g, w, decay) -> None running one pass (`Pass`) of
        update number `count` (0-based: updates already applied) over one chunk, at learning rate
        `lr`; gradients are multiplied by `gmul` (averaging, loss scale and clipping in one factor).
        Arrays are flat: p float32; moments float32 or bf16 bits (uint16); g likewise; w the compute
        dtype (bf16 bits or float32), None for the `STATE` pass."""
        pass_ = Pass(pass_)
        f32 = np.float32
        gmul, neg_lr = f32(gmul), -f32(lr)
        unit = self.exact_ones(count)
        if self.name in ("adamw", "adam"):
            name, scalars = "adam", (f32(self.b1), f32(self.b2), f32(self.eps), *self._corrections(count))
        elif self.name == "lion":
            name, scalars = "lion", (f32(self.b1), f32(self.b2))
        elif self.momentum:
            name, scalars = "sgd_momentum", (f32(self.momentum),)
        else:
            name, scalars = "sgd", ()

        def run(p, *arrays_and_decay):
            *moments, g, w, wd = arrays_and_decay
            m16 = bool(moments) and moments[0].dtype == np.uint16
            w16 = w is not None and w.dtype == np.uint16
            k = _kernel(name, g.dtype == np.uint16, m16, w16, pass_, unit)
            arrays = [p, *moments, g] + [w] * (pass_ is not Pass.STATE)
            k(*arrays, _scratch(), gmul, *scalars, neg_lr, f32(wd))

        return run


def chunks(n: int, size: int | None = None) -> list[slice]:
    """[0, n) cut into slices of at most `size` (default `CHUNK`)."""
    size = size or CHUNK
    return [slice(lo, min(lo + size, n)) for lo in range(0, n, size)]

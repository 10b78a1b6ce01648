"""The measured constants of the planner's cost model and of the memory plan, in one data module.

Each constant names the subsection of BENCHMARKS.md, "The planner's calibration (where its constants
come from)", that gives its value, the fact behind it and where that fact was measured; a constant
changes when that measurement does. Units: bytes, bytes/s, FLOP/s, fractions. Nothing here reads the
machine or the config: `jaxzero.planner.machine` and `jaxzero.planner.cost` apply these figures,
`jaxzero.planner.memory` counts with them.
"""

from __future__ import annotations

from fractions import Fraction

GiB = 2**30
MiB = 2**20
GB = 10**9

# ---------------------------------------------------------------------------------------------------
# The boxes the defaults were measured on: one H200 or H100 on PCIe Gen5, 16 cores, 125 GiB of RAM
# ---------------------------------------------------------------------------------------------------

# Bytes/s each way between pinned host memory and one GPU of those boxes.
# BENCHMARKS.md, "Calibration: the link and the GPU"
LINK_BPS = 54 * GB
# Dense FLOP/s (8N accounting) an H200's steps reach.
# BENCHMARKS.md, "Calibration: the link and the GPU"
H200_FLOPS = 590e12
# An H100's dense step rate as a share of the H200's: resident steps of the 3.37B model.
# BENCHMARKS.md, "Calibration: the link and the GPU"
H100_OF_H200 = 0.98
# An H100's rate for attention past `CALIBRATION_SEQ` as a share of the H200's: its long-sequence steps.
# BENCHMARKS.md, "Calibration: the link and the GPU"
H100_ATTENTION_OF_H200 = 0.7
# The rate of a mixture of experts' grouped matmuls (forward and backward of one layer, routing
# included) as a share of the dense rate, per grouping (`model.moe_impl`): (most, half) gives
# most * i / (i + half), where i = 1 / (1/rows + 1/width + 1/hidden) grows with each expert's matmul
# (rows: a micro-batch's tokens x top-k / experts). Fitted to Qwen3-30B-A3B's layer (i = 361:
# 0.41 and 0.25) and Mixtral's (i = 1,793: 0.69 and 0.28) on an H100.
# BENCHMARKS.md, "Calibration: the experts' grouped matmuls"
EXPERTS_SHARE_OF_DENSE = {"mosaic": (0.834, 373.0), "padded": (0.289, 56.0)}
# Below the smallest intensity measured the curve is not extrapolated: smaller matmuls take its share.
EXPERTS_LEAST_INTENSITY = 361.0
# What XLA's GPU allocator leaves out of a GPU's memory before taking its fraction: the CUDA context.
# BENCHMARKS.md, "Calibration: the link and the GPU"
CUDA_CONTEXT_BYTES = 640 * MiB

# Bytes/s of host memory traffic the fused host update reaches on `MEASURED_CORES` cores.
# BENCHMARKS.md, "Calibration: the host update"
HOST_UPDATE_BPS = 120 * GB
# The cores `HOST_UPDATE_BPS` was measured on; fewer reach sqrt(cores / MEASURED_CORES) of it.
# BENCHMARKS.md, "Calibration: the host update"
MEASURED_CORES = 16
# A two-pass unit's passes move their bytes at these shares of `HOST_UPDATE_BPS`: the first (new
# weights: 16 bytes of 4-byte reads and 2-byte writes) slower, the second (in place) faster.
# BENCHMARKS.md, "Calibration: the host update"
WEIGHTS_PASS_SHARE = 0.8
STATE_PASS_SHARE = 1.2
# optax's update on XLA:CPU takes this many times the fused kernels' time per parameter.
# BENCHMARKS.md, "Calibration: the host update"
OPTAX_SLOWDOWN = 4.48 / 2.56

# Bytes/s the disk tier's store reads and writes, together, on the boxes' local disk.
# BENCHMARKS.md, "Calibration: the disk"
DISK_BPS = 2.0 * GB

# ---------------------------------------------------------------------------------------------------
# The cost model's step
# ---------------------------------------------------------------------------------------------------

# The tokens per sequence of the steps the rates were fitted to; attention past them is costed apart.
# BENCHMARKS.md, "Calibration: attention past 2,048 tokens"
CALIBRATION_SEQ = 2048
# Attention's FLOPs past `CALIBRATION_SEQ` run at 1 / ATTENTION_COST of the dense rate.
# BENCHMARKS.md, "Calibration: attention past 2,048 tokens"
ATTENTION_COST = 0.68

# ---------------------------------------------------------------------------------------------------
# The memory plan, and the room a chosen placement leaves
# ---------------------------------------------------------------------------------------------------

# The share of the host RAM a process sees that a placement the planner chooses leaves free.
# BENCHMARKS.md, "Calibration: headroom"
HOST_HEADROOM = 0.05
# The share of the accelerator's usable memory that a placement the planner chooses leaves free.
# BENCHMARKS.md, "Calibration: headroom"
GPU_HEADROOM = 0.05

# What a GPU process holds in host RAM besides its arrays and pools (CUDA context, XLA, Python), per
# GPU it drives. BENCHMARKS.md, "Calibration: the process and XLA's pinned pool"
GPU_PROCESS_RSS = 5 * GiB
# What an offloaded GPU process holds besides that: the host update's threads and their buffers, XLA's
# CPU client, the batch pipeline. BENCHMARKS.md, "Calibration: the process and XLA's pinned pool"
OFFLOAD_PROCESS_RSS = 5 * GiB
# XLA's pinned pool grows by regions of this size doubled until one holds the request.
# BENCHMARKS.md, "Calibration: the process and XLA's pinned pool"
POOL_FIRST_REGION = 2 * MiB
# The start-up reservation asks this much more than the pinned arrays, for the allocator's fragmentation.
# BENCHMARKS.md, "Calibration: the process and XLA's pinned pool"
POOL_SLACK = Fraction(1, 50)
# Pinned arrays filling more than this of the start-up region grow a second region as large.
# BENCHMARKS.md, "Calibration: the process and XLA's pinned pool"
POOL_FILL = Fraction(9, 10)

# Orbax's and TensorStore's working memory during a save or a restore, beside the buffer and the unit.
# BENCHMARKS.md, "Calibration: checkpoints"
SAVE_WORKING_BYTES = 128 * MiB
# What the checkpoint writer moves to the local disk, bytes/s per host, all its processes together.
# BENCHMARKS.md, "Calibration: checkpoints"
CHECKPOINT_WRITE_BPS = 1.3 * GB
# The share of a run's time its saves may block training before the run is warned.
SAVE_COST_WARNING = 0.05

# On a CPU backend, where one RAM holds everything: the host state's and the devices' state's share
# with XLA:CPU's and the checkpoint writer's buffers beside them.
# BENCHMARKS.md, "Calibration: a CPU backend's allowances"
CPU_HOST_ALLOWANCE = Fraction(3, 2)
CPU_STATE_ALLOWANCE = Fraction(5, 4)

"""The DeepSpeed config keys jaxzero knows: those it maps (`jaxzero.deepspeed.mapping`), those that
mean nothing here (with why, listed in the translation's report), and the features it refuses.

An unknown key is an error naming its path; each section's table of known keys is checked by
`Reader.section`."""

from __future__ import annotations

# Keys DeepSpeed accepts that have no jaxzero meaning, with why; a whole section's contents are not
# read when the section itself is listed.
IGNORED_TOP = {
    "wall_clock_breakdown": "the offload step's time breakdown is always in metrics.jsonl",
    "memory_breakdown": "peak accelerator and host memory are always in metrics.jsonl",
    "dump_state": "the resolved config is written to <run_dir>/config.json",
    "prescale_gradients": "gradients are reduced in float32 by XLA; no pre-scaling is needed",
    "gradient_predivide_factor": "gradients are reduced in float32 by XLA; no pre-division is needed",
    "communication_data_type": "XLA reduces gradients in their own dtype (float32 masters' gradients)",
    "gradient_allreduce_op": "gradients are averaged over the data axis by XLA",
    "sparse_gradients": "embedding gradients are dense arrays in JAX",
    "managed_gradient_accumulation": "data.grad_accum micro-batches are always summed inside the step",
    "zero_allow_untested_optimizer": "every optimizer jaxzero offers runs under every ZeRO stage",
    "zero_force_ds_cpu_optimizer": "the host update is jaxzero's own fused kernel or optax on XLA:CPU",
    "wandb": "jaxzero writes metrics.jsonl and TensorBoard events, not Weights & Biases",
    "comet": "jaxzero writes metrics.jsonl and TensorBoard events, not Comet",
    "csv_monitor": "metrics.jsonl is the machine-readable log",
    "comms_logger": "XLA issues the collectives; --profile.steps traces them",
    "flops_profiler": "model FLOPs and MFU are in every metrics.jsonl record; --profile.steps traces a step",
    "autotuning": "the placement planner (offload.*=auto) chooses the memory/speed settings",
    "aio": "the disk tier reads and writes with its own thread pool and aligned buffers",
    "checkpoint": "checkpoints are Orbax's, in <run_dir>/checkpoints (checkpoint.*)",
    "nebula": "checkpoints are Orbax's, in <run_dir>/checkpoints (checkpoint.*)",
    "data_types": "gradients are accumulated in float32",
    "pipeline": "jaxzero has no pipeline parallelism; the devices form one data axis",
    "steps_per_print_throughput": "throughput is in every metrics.jsonl record",
}
# Sections whose feature, when switched on, would change the training jaxzero runs: refused.
REFUSED_WHEN_ENABLED = {
    "amp": "NVIDIA Apex AMP; use bf16 or fp16",
    "torch_autocast": "torch.autocast; use bf16 or fp16 (model.compute_dtype)",
    "curriculum_learning": "curriculum learning",
    "data_efficiency": "data efficiency (curriculum sampling, random layer-token drop)",
    "progressive_layer_drop": "progressive layer dropping",
    "elasticity": "elastic batch sizes",
    "hybrid_engine": "the RLHF hybrid engine",
    "eigenvalue": "eigenvalue computation",
    "quantize_training": "quantization-aware training",
    "expert_parallel": "mixture-of-experts parallelism",
}
REFUSED_WHEN_PRESENT = {
    "sparse_attention": "sparse attention (jaxzero computes dense causal attention)",
    "compression_training": "compression training (quantization, pruning, layer reduction)",
}
TOP_KEYS = {
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "optimizer",
    "scheduler",
    "fp16",
    "bf16",
    "bfloat16",
    "gradient_clipping",
    "zero_optimization",
    "steps_per_print",
    "activation_checkpointing",
    "tensorboard",
    "tensor_parallel",
    "sequence_parallel_size",
    *IGNORED_TOP,
    *REFUSED_WHEN_ENABLED,
    *REFUSED_WHEN_PRESENT,
}

_EXPORT = "python -m jaxzero.export writes the weights in bf16 or fp32"
ZERO_IGNORED = {
    "allgather_partitions": "XLA gathers each streamed or sharded block whole",
    "allgather_bucket_size": "XLA sizes its collectives",
    "overlap_comm": "copies and collectives always overlap compute (one block ahead)",
    "reduce_scatter": "ZeRO-2/3 gradients are always reduce-scattered",
    "reduce_bucket_size": "XLA sizes its collectives",
    "contiguous_gradients": "each unit's gradient is one contiguous buffer already",
    "load_from_fp32_weights": "checkpoints always hold the float32 masters",
    "grad_hooks": "gradients are produced per block by the streamed backward pass",
    "round_robin_gradients": "each process updates its own rows of every unit",
    "stage3_max_live_parameters": "one block is live at a time, plus the one being prefetched",
    "stage3_max_reuse_distance": "blocks are fetched again for the backward pass; the plan decides residency",
    "stage3_prefetch_bucket_size": "the next block is always prefetched while one computes",
    "stage3_param_persistence_threshold": "units stay whole; offload.resident_blocks keeps blocks resident",
    "stage3_module_granularity_threshold": "the unit of streaming is one transformer block",
    "stage3_gather_16bit_weights_on_model_save": _EXPORT,
    "stage3_gather_fp16_weights_on_model_save": _EXPORT,
    "gather_16bit_weights_on_model_save": _EXPORT,
    "sub_group_size": "the host update runs one unit (a block) at a time",
    "elastic_checkpoint": "checkpoints restore on any device count",
    "ignore_unused_parameters": "every parameter takes part in each step",
    "legacy_stage1": "ZeRO stages are XLA shardings",
    "log_trace_cache_warnings": "no module tracing: blocks are compiled once",
    "memory_efficient_linear": "XLA decides the linear layers' buffers",
    "cpu_offload_use_pin_memory": "streamed state is always in pinned host memory",
    "mics_hierarchical_params_gather": "no MiCS: ZeRO shards over the whole data axis",
    "use_multi_rank_bucket_allreduce": "XLA sizes its collectives",
    "zeropp_loco_param": "no quantized ZeRO++ communication",
    "pipeline_loading_checkpoint": "checkpoints are Orbax's",
    "override_module_apply": "no module hooks: blocks are compiled functions",
}
ZERO_KEYS = {
    "stage",
    "offload_optimizer",
    "offload_param",
    "cpu_offload",
    "cpu_offload_params",
    "zero_hpz_partition_size",
    "mics_shard_size",
    "zero_quantized_weights",
    "zero_quantized_gradients",
    "zero_quantized_nontrainable_weights",
    *ZERO_IGNORED,
}
OFFLOAD_IGNORED = {
    "pin_memory": "host state the accelerator reads is always pinned",
    "buffer_count": "the disk tier sizes its pinned buffers from the plan",
    "buffer_size": "the disk tier sizes its pinned buffers from the plan",
    "max_in_cpu": "the planner decides what stays in host RAM",
    "fast_init": "the state is initialised where it lives",
    "pipeline": "disk reads and writes always overlap the update",
    "pipeline_read": "disk reads always overlap the update",
    "pipeline_write": "disk writes always overlap the update",
}
# jaxzero's batch keys and the DeepSpeed keys that set them (DeepSpeed's rule: train_batch_size =
# train_micro_batch_size_per_gpu x gradient_accumulation_steps x GPUs).
BATCH_KEYS = {
    "data.batch_size": "train_batch_size",
    "data.micro_batch_size": "train_micro_batch_size_per_gpu",
    "data.grad_accum": "gradient_accumulation_steps",
}

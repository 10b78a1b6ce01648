"""`--deepspeed=ds_config.json`: a DeepSpeed config file read as jaxzero settings.

Every key with a jaxzero meaning becomes a dotted override (`translate`), applied above a preset and
below the command line's own `--section.key=value`:

    train_batch_size, train_micro_batch_size_per_gpu,   data.batch_size, data.micro_batch_size,
    gradient_accumulation_steps                         data.grad_accum (DeepSpeed's rule: batch =
                                                        micro x accumulation x devices; one missing
                                                        is derived once the devices are known)
    zero_optimization.stage                             parallel.zero_stage
    zero_optimization.offload_optimizer.device          offload.optimizer (cpu, nvme -> disk, none)
      .nvme_path, .ratio                                offload.disk_path, offload.device_state_units
    zero_optimization.offload_param.device              offload.params (cpu; nvme -> cpu, see notes)
    fp16.*, bf16.enabled, bf16.bf16_optimizer_states    model.compute_dtype, fp16.*, optimizer.state_dtype
    optimizer (Adam, AdamW, Lion, SGD) and its params   optimizer.*
    scheduler (WarmupLR, WarmupDecayLR, WarmupCosineLR) optimizer.schedule, warmup_*, decay_steps, ...
    gradient_clipping, steps_per_print                  optimizer.grad_clip, logging.log_every
    activation_checkpointing.cpu_checkpointing          offload.activations=cpu
    tensorboard.enabled                                 logging.tensorboard

A value of "auto" leaves the key to jaxzero (its default, a preset or the command line), as the
Hugging Face Trainer fills "auto" from its own arguments. Keys DeepSpeed knows that mean nothing here
(bucket sizes XLA decides, pinning jaxzero always does, loggers of other tools) are listed with why;
features that would change the training (quantized ZeRO, curriculum learning, static loss scaling,
...) are refused. Unknown keys and values of the wrong type are errors naming the key path. A value
the file set that jaxzero refuses (a batch that breaks DeepSpeed's rule, a rate out of range, offload
without the ZeRO stage it needs, ...) is refused in the file's own keys and values, with the
arithmetic (`check`): the user reads their own file, not jaxzero's settings.

The package: `reading` (the JSON file, typed access to its keys, the `Translation` it yields), `keys`
(the keys jaxzero knows, ignores with why, or refuses), `mapping` (`translate`, section by section),
`optimizer` (the optimizer and scheduler sections), `refusals` (`check`).
"""

from jaxzero.deepspeed.mapping import translate
from jaxzero.deepspeed.reading import AUTO, Translation, load
from jaxzero.deepspeed.refusals import check

__all__ = ["AUTO", "Translation", "check", "load", "translate"]

"""Fine-tuning what does not train whole: LoRA adapters over a frozen base (`finetune.method=lora`), or
the units `finetune.freeze` leaves trainable.

    jaxzero.finetune.adapters   which projections get adapters, their shapes and init
    jaxzero.finetune.trainable  what trains, as a tree beside the base's units
    jaxzero.finetune.base       the frozen base: bfloat16 or int8 units, resident or streamed
    jaxzero.finetune.part       what trains over the base, as the engine builds from it (`TrainableOverBase`)
    (its memory and step: `jaxzero.planner.partial`; the base's placement: the planner's search)
    jaxzero.finetune.merged     its model as plain float32 weights, for sampling, evaluation, export
"""

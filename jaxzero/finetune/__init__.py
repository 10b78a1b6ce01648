"""Fine-tuning what does not train whole: LoRA adapters over a frozen base (`finetune.method=lora`).

jaxzero.finetune.adapters   which projections get adapters, their shapes and init
jaxzero.finetune.base       the frozen base: bfloat16 or int8 units, resident or streamed
jaxzero.finetune.trainer    the LoRA trainer (`build_lora_trainer`), a `jaxzero.state.Trainer`
"""

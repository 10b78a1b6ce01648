"""Hugging Face interop: export jaxzero parameters as a transformers checkpoint, import one back.

    paths = export_hf(params, cfg, "out/")       # config.json + model.safetensors (or shards + index)
    model = transformers.AutoModelForCausalLM.from_pretrained("out/")
    cfg, params = import_hf("some-hf-checkpoint/")  # float32 NumPy ModelParams
    params = load_hf_into(run_cfg, "some-hf-checkpoint/")  # same, checked against a run's config
    params = load_hf_by_unit(run_cfg, "some-hf-checkpoint/")  # same, each unit read when placed
    model, params = from_export("export/x")  # an Orbax export (model.json beside it) or an HF one

`hf_names` maps each parameter to its HF tensor name and layout, `hf_config_map` translates config.json to
and from ModelConfig, `hf_io` reads and writes checkpoint directories, and `safetensors` is the file
format (NumPy only; neither transformers nor the `safetensors` package is needed at runtime); `exports`
reads either kind of export, Orbax (`jaxzero.storage.orbax_export`) or Hugging Face.
"""

from jaxzero.interop.exports import from_export, load_by_unit
from jaxzero.interop.hf_config_map import EXPORT_DTYPES, hf_config, model_config_from_hf
from jaxzero.interop.hf_io import export_hf, import_hf, load_hf_by_unit, load_hf_into
from jaxzero.interop.hf_names import hf_tensor_names

__all__ = [
    "EXPORT_DTYPES",
    "export_hf",
    "from_export",
    "hf_config",
    "hf_tensor_names",
    "import_hf",
    "load_by_unit",
    "load_hf_by_unit",
    "load_hf_into",
    "model_config_from_hf",
]

"""LoRA: low-rank adapters beside frozen linear layers (LoraSpec, LoraLinear, add_adapters) and PEFT's adapter
folder format (save_adapter, load_adapter), which `PeftModel.from_pretrained` reads and writes."""

"""LoRA adapters on Megatron models: put them on built chunks, train only them, switch them off for
the reference policy, and move them in and out (full tensors, PEFT's format, merged Hugging Face
weights). Implementation: :mod:`fnppo.megatron.lora`, :mod:`fnppo.megatron.lora_linear`, :mod:`fnppo.io.hf.peft`."""

from __future__ import annotations

from fnppo.io.hf.peft import load_peft_adapter as load_peft_adapter
from fnppo.io.hf.peft import lora_config_from_peft as lora_config_from_peft
from fnppo.io.hf.peft import save_peft_adapter as save_peft_adapter
from fnppo.megatron.lora import TARGETS as TARGETS
from fnppo.megatron.lora import LoRAConfig as LoRAConfig
from fnppo.megatron.lora import adapter_names as adapter_names
from fnppo.megatron.lora import adapters_off as adapters_off
from fnppo.megatron.lora import apply_lora as apply_lora
from fnppo.megatron.lora import is_adapter as is_adapter
from fnppo.megatron.lora import lora_config_of as lora_config_of
from fnppo.megatron.lora import snapshot_adapters as snapshot_adapters

__all__ = [
    "LoRAConfig",
    "TARGETS",
    "apply_lora",
    "adapters_off",
    "snapshot_adapters",
    "adapter_names",
    "lora_config_of",
    "is_adapter",
    "save_peft_adapter",
    "load_peft_adapter",
    "lora_config_from_peft",
]

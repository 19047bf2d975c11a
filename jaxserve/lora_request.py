"""vLLM's `LoRARequest`: which adapter a request runs with (offline `LLM.generate(..., lora_request=)`)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter (`adapter_config.json` and `adapter_model.safetensors` in `lora_path`).

    `lora_int_id` identifies this load of the adapter: > 0, and another id (or path) under the
    same name is another adapter, whose prefix-cache pages are its own."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id={self.lora_int_id} must be >= 1 (0 is the base model)")

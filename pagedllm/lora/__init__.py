"""LoRA adapters: many fine-tunes served from one base model (request.py: what a request names; adapter.py: an
adapter's weights read from PEFT's format; layers.py: the adapters' products inside the linear layers; manager.py: the
worker's adapters in memory and in the step's slots)."""

from pagedllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]

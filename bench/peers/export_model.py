"""Write the benchmark weights once as an fp32 Hugging Face folder that every engine loads.

The default model ships as a Q4_1 GGUF; pagedllm and HF transformers de-quantize it themselves, but vLLM's CPU
backend loads safetensors folders. So the peer harness de-quantizes the GGUF with transformers (the reference
loader) and saves config, fp32 safetensors and tokenizer into one folder; pagedllm, HF and vLLM then all read
exactly the same numbers.

    python bench/peers/export_model.py [--gguf PATH] [--out DIR]    # prints the folder
"""

from __future__ import annotations

import argparse
import os
import sys

DEFAULT_OUT = os.path.join(
    os.environ.get("PAGEDLLM_CACHE_DIR", os.path.expanduser("~/.cache/pagedllm")), "bench", "SmolLM2-135M-Instruct-f32"
)


def export(gguf: str, out: str) -> str:
    """De-quantize `gguf` to an fp32 HF folder at `out` (skipped when it is already there)."""
    if os.path.isfile(os.path.join(out, "model.safetensors")) and os.path.isfile(os.path.join(out, "config.json")):
        return out
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.logging.set_verbosity_error()
    folder, name = os.path.dirname(gguf), os.path.basename(gguf)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained (it remembers its quantization); copy the de-quantized
    # weights into a plain model built from the same config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tmp = out + ".tmp"
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    os.replace(tmp, out)
    return out


def main(argv: list[str] | None = None) -> int:
    from pagedllm.config import default_model_path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", default=None, help="GGUF file (default: the default model's)")
    parser.add_argument("--out", default=DEFAULT_OUT, help="output folder (default: %(default)s)")
    args = parser.parse_args(argv)
    print(export(args.gguf or default_model_path(), args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

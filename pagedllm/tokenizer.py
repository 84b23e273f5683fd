"""Tokenizer loading: from an HF folder, or from a GGUF file's metadata (via transformers), never a hub.

Converting a GGUF vocabulary into a fast tokenizer takes seconds, so the converted tokenizer is saved once
under the cache directory (keyed on the file's path, size and mtime and the transformers version) and
loaded from there afterwards.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import time
from typing import Any

from pagedllm.config import ModelConfig, cache_dir

logger = logging.getLogger(__name__)


def _gguf_cache_path(gguf_path: str) -> str:
    import transformers

    st = os.stat(gguf_path)
    key = f"{os.path.abspath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    return os.path.join(cache_dir(), "tokenizers", hashlib.sha256(key.encode()).hexdigest()[:24])


def get_tokenizer(model_config: ModelConfig) -> Any:
    """The model's tokenizer: from its folder, or from its GGUF file through the conversion cache."""
    start = time.perf_counter()
    tokenizer, source = _load_tokenizer(model_config)
    if model_config.chat_template is not None:  # --chat-template replaces the model's own
        tokenizer.chat_template = model_config.chat_template
    logger.info("startup: tokenizer %.2f s (%s)", time.perf_counter() - start, source)
    return tokenizer


def _load_tokenizer(model_config: ModelConfig) -> tuple[Any, str]:
    if not model_config.gguf_file:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_config.tokenizer, local_files_only=True), "from the model folder"
    gguf_path = os.path.join(model_config.tokenizer, model_config.gguf_file)
    cached = _gguf_cache_path(gguf_path)
    if os.path.isfile(os.path.join(cached, "tokenizer_config.json")):
        # The cached conversion is a fast tokenizer (tokenizer.json) that we saved: loaded as one directly.
        # AutoTokenizer would give the same class, but importing it imports torch (2-3 s), which the front end of
        # `pagedllm serve` otherwise never needs, while the engine core loads beside it on the same two cores.
        from transformers import PreTrainedTokenizerFast

        try:
            tokenizer = PreTrainedTokenizerFast.from_pretrained(cached, local_files_only=True)
            return tokenizer, "GGUF conversion from the cache"
        except Exception as e:  # a damaged cache entry is rebuilt, never fatal
            logger.warning("ignoring unreadable tokenizer cache %s: %s", cached, e)
    tokenizer = _convert_gguf_tokenizer(model_config.tokenizer, model_config.gguf_file)
    try:
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(cached))
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(cached, ignore_errors=True)
        os.replace(tmp, cached)
    except OSError as e:  # a read-only home only costs the conversion next time
        logger.warning("could not cache the converted tokenizer at %s: %s", cached, e)
    return tokenizer, "converted from the GGUF"


def _convert_gguf_tokenizer(folder: str, gguf_file: str) -> Any:
    """transformers' conversion of a GGUF file's tokenizer (AutoTokenizer: the model's own tokenizer class). It reads
    the file's metadata only for the architectures transformers models (and its gpt-oss reader fails on the files
    llama.cpp writes), though the tokenizer (`tokenizer.ggml.*`) does not depend on the architecture: for those,
    the same conversion (`get_gguf_tokenizer`, `convert_gguf_tokenizer`) wrapped in a plain fast tokenizer."""
    from transformers import AutoTokenizer

    from pagedllm.model.gguf_file import fast_full_reader

    try:
        # transformers reads the file's config with gguf's reader first (10 s over Gemma 3's 262k tokens; ~1 s here)
        with fast_full_reader():
            return AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file, local_files_only=True)
    except (ValueError, TypeError, KeyError) as exc:
        from transformers import PreTrainedTokenizerFast
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

        arch, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(os.path.join(folder, gguf_file))
        logger.info("GGUF tokenizer of architecture %r converted without its model class (%s)", arch, exc)
        backend, extra = convert_gguf_tokenizer(arch, tokenizer_dict)
        return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)


# llama.cpp's end-of-generation tokens, found by their text among a GGUF file's special tokens (llama-vocab.cpp): the
# file names one eos, but a chat model also ends its turns with one of these (Phi-3's <|end|>, Gemma's
# <end_of_turn>, Llama 3's <|eot_id|> and <|eom_id|>, gpt-oss's <|return|> and <|call|>).
GGUF_EOG_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
    "<EOT>", "_<EOT>", "<|end_of_text|>",
)  # fmt: skip


def end_token_ids(tokenizer: Any, mc: ModelConfig, eos: int | None) -> list[int]:
    """The tokens besides `eos` that end a request (unless it ignores eos): the generation config's eos_token_id
    list (vLLM's rule), and for a GGUF file its end-of-turn and end-of-message tokens and the special tokens of
    GGUF_EOG_TEXTS (llama.cpp's rule; as llama.cpp, not <|end|> where <|return|> and <|call|> exist: gpt-oss ends a
    message, not its turn, with it). Only special or added tokens of this tokenizer: a generation config read for
    another model (--generation-config FOLDER, a folder of GGUF files) names ordinary tokens of this one."""
    added = tokenizer.get_added_vocab()
    special = set(added.values()) | set(getattr(tokenizer, "all_special_ids", ()) or ())
    ids = [i for i in mc.generation_eos_ids if i in special]
    if mc.gguf_file is not None:
        ids += [i for i in (getattr(mc.hf_config, k, None) for k in ("eot_token_id", "eom_token_id")) if i is not None]
        ids += [added[text] for text in GGUF_EOG_TEXTS if text in added]
    if "<|return|>" in added and "<|call|>" in added:  # harmony, whatever named <|end|> (a file's eot, say)
        ids = [i for i in ids if i != added.get("<|end|>")]
    vocab = mc.vocab_size
    return [i for i in dict.fromkeys(ids) if i != eos and 0 <= i < vocab]


def eos_token_id(tokenizer: Any, hf_config: Any) -> int | None:
    if getattr(tokenizer, "eos_token_id", None) is not None:
        return int(tokenizer.eos_token_id)
    eos = getattr(hf_config, "eos_token_id", None)
    if isinstance(eos, list):
        return eos[0] if eos else None
    return eos

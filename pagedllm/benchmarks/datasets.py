"""Benchmark workloads shared by `pagedllm bench serve` and `pagedllm bench throughput` (modelled on vLLM's).

Every generator returns a list of `SampleRequest`: the prompt as text (what an HTTP client sends), the token
ids that text encodes to with the benchmark's tokenizer (``add_special_tokens=False``; what an offline run
feeds the engine), its length, and the number of output tokens to ask for. Generators are deterministic in
their seed and raise `ValueError` naming a bad value.

* ``random``: prompt lengths uniform (inclusive) in ``[floor(L*(1-r)), ceil(L*(1+r))]`` for ``--random-input-len
  L`` and ``--random-range-ratio r`` (output lengths the same way). Each prompt is drawn as random non-special
  token ids, decoded to text, re-encoded and adjusted (tokens dropped or added at the end, a few rounds) until
  the text encodes to the wanted number of tokens, or as close as the tokenizer allows.
* ``sharegpt``: a ShareGPT-format JSON file (a list of ``{"conversations": [{"from": "human", "value": ...},
  {"from": "gpt", "value": ...}, ...]}``); the first human turn is the prompt, and the output length is the
  token count of the gpt reply that follows it (or ``--sharegpt-output-len``). Entries without such a pair,
  with an empty prompt or reply, or longer than ``max_model_len`` (when known) are skipped. Entries are
  shuffled with the seed; when fewer usable entries exist than requests, they are reused in order.
* ``prefix-repetition``: ``num_prefixes`` random prefixes of ``prefix_len`` tokens; every prompt is one of
  them followed by a random suffix, so that prompt's length is ``prefix_len + suffix_len`` (adjusted as for
  random). Requests are spread evenly over the prefixes and shuffled: a prefix cache can serve the prefixes.

* ``repeat``: prompts whose answer repeats their input, the workload of speculative decoding's n-gram proposer:
  one of a few built-in passages (prose and code) in a completion that asks for it again ("Here is a quote: ...
  The same quote again:"), the output length the passage's token count (or ``--repeat-output-len``). Passages
  come in turn, in a seeded order that changes every round of them: any N prompts hold each passage N // P or
  N // P + 1 times (P passages), so that a small sample weighs them alike (drawn independently, the 8 prompts of
  seed 0 held one passage three times).

`load_tokenizer` loads a tokenizer from a ``.gguf`` file, a folder holding one, or an HF folder with tokenizer
files, never from a hub; `add_dataset_args` adds the shared flags and `sample_requests` dispatches on them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

DATASETS = ("random", "sharegpt", "prefix-repetition", "repeat")
_ADJUST_ROUNDS = 10  # decode -> encode -> fix rounds before settling for the closest length seen
_HUMAN_ROLES = ("human", "user")
_GPT_ROLES = ("gpt", "assistant", "chatgpt", "bard", "bing")


@dataclass(slots=True)
class SampleRequest:
    prompt: str  # the text sent to a server
    prompt_token_ids: list[int]  # [prompt_len] the text encoded without special tokens
    prompt_len: int
    expected_output_len: int  # max_tokens to ask for


# ---- tokenizer ------------------------------------------------------------------------------------------------


def load_tokenizer(path: str | None) -> Any:
    """A tokenizer from a .gguf file, a folder with exactly one .gguf, or an HF folder; None: the default model."""
    from pagedllm.config import default_model_path

    path = os.path.abspath(os.path.expanduser(path or default_model_path()))
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        names = os.listdir(path)
        if any(n in names for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(path, local_files_only=True)
    if not os.path.exists(path):
        raise ValueError(
            f"tokenizer {path!r} does not exist: give a .gguf file or a folder with tokenizer files "
            "(tokenizers are never downloaded)"
        )
    from pagedllm.model.config_loader import load_model_config
    from pagedllm.tokenizer import get_tokenizer

    return get_tokenizer(load_model_config(path))


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def regular_token_ids(tokenizer: Any) -> np.ndarray:
    """Ids a random prompt may use: the vocabulary without special and added (control) tokens."""
    excluded = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    ids = sorted(set(tokenizer.get_vocab().values()) - excluded)
    if not ids:
        raise ValueError("the tokenizer has no regular (non-special) tokens to draw random prompts from")
    return np.asarray(ids, dtype=np.int64)


def fit_to_length(
    tokenizer: Any,
    target_len: int,
    rng: np.random.Generator,
    allowed: np.ndarray,
    head_ids: list[int] | None = None,
) -> tuple[str, list[int]]:
    """Text that encodes to `target_len` tokens (or as close as found): `head_ids` then random tokens.

    The head is kept as given; only the random tail is shortened or extended after each re-encoding.
    Returns (text, its token ids).
    """
    head = list(head_ids or [])
    tail = rng.choice(allowed, size=max(target_len - len(head), 0)).tolist()
    best: tuple[str, list[int]] | None = None
    for _ in range(_ADJUST_ROUNDS):
        text = tokenizer.decode(head + tail)
        ids = encode(tokenizer, text)
        if best is None or abs(len(ids) - target_len) < abs(len(best[1]) - target_len):
            best = (text, ids)
        diff = len(ids) - target_len
        if diff == 0 or (diff > 0 and not tail):
            break
        tail = tail[:-diff] if diff > 0 else tail + rng.choice(allowed, size=-diff).tolist()
    assert best is not None
    return best


# ---- generators ------------------------------------------------------------------------------------------------


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """vLLM's random-dataset bounds: [floor(length * (1 - r)), ceil(length * (1 + r))], at least 1."""
    return max(1, math.floor(length * (1 - range_ratio))), max(1, math.ceil(length * (1 + range_ratio)))


def sample_random(
    tokenizer: Any,
    num_requests: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    prefix_len: int = 0,
) -> list[SampleRequest]:
    """Random prompts of `input_len` tokens (within the range ratio), each after the same random prefix of
    `prefix_len` tokens (vLLM's --random-prefix-len: a prefix the server may cache), and their output lengths."""
    _check_positive(num_requests=num_requests, input_len=input_len, output_len=output_len)
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"random range ratio must be in [0, 1), got {range_ratio}")
    if prefix_len < 0:
        raise ValueError(f"random prefix length must be >= 0, got {prefix_len}")
    rng = np.random.default_rng(seed)
    allowed = regular_token_ids(tokenizer)
    prefix = rng.choice(allowed, size=prefix_len).tolist() if prefix_len else []  # no draw: seeds keep their prompts
    in_lo, in_hi = length_range(input_len, range_ratio)
    out_lo, out_hi = length_range(output_len, range_ratio)
    in_lens = rng.integers(in_lo, in_hi + 1, size=num_requests)
    out_lens = rng.integers(out_lo, out_hi + 1, size=num_requests)
    requests = []
    for n, out in zip(in_lens, out_lens):
        text, ids = fit_to_length(tokenizer, prefix_len + int(n), rng, allowed, head_ids=prefix)
        requests.append(SampleRequest(text, ids, len(ids), int(out)))
    return requests


def sample_prefix_repetition(
    tokenizer: Any,
    num_requests: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    seed: int = 0,
) -> list[SampleRequest]:
    _check_positive(num_requests=num_requests, prefix_len=prefix_len, num_prefixes=num_prefixes, output_len=output_len)
    if suffix_len < 0:
        raise ValueError(f"prefix-repetition suffix length must be >= 0, got {suffix_len}")
    if num_prefixes > num_requests:
        raise ValueError(f"num_prefixes ({num_prefixes}) cannot exceed the number of requests ({num_requests})")
    rng = np.random.default_rng(seed)
    allowed = regular_token_ids(tokenizer)
    requests = []
    for i in range(num_prefixes):
        _, prefix_ids = fit_to_length(tokenizer, prefix_len, rng, allowed)
        # Spread the requests evenly: the first (num_requests % num_prefixes) prefixes get one more.
        for _ in range(num_requests // num_prefixes + (i < num_requests % num_prefixes)):
            text, ids = fit_to_length(tokenizer, prefix_len + suffix_len, rng, allowed, head_ids=prefix_ids)
            requests.append(SampleRequest(text, ids, len(ids), output_len))
    order = rng.permutation(len(requests))
    return [requests[i] for i in order]


REPEAT_PASSAGES = (
    (
        "quote",
        "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
        "metal type, oil-based ink and a wooden press adapted from those used to make wine. Before his invention, "
        "books in Europe were copied by hand, usually by monks, and a single Bible could take years to finish.",
    ),
    (
        "quote",
        "A lighthouse keeper's day began before dawn. He trimmed the wick, polished the great lens until it shone, "
        "wound the clockwork that turned the light, and wrote the weather in the log: wind from the west, sea "
        "moderate, visibility good. At dusk he climbed the stairs again and lit the lamp for the ships at sea.",
    ),
    (
        "file",
        "def merge(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
        "        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n        else:\n"
        "            out.append(b[j])\n"
        "            j += 1\n    return out + a[i:] + b[j:]\n",
    ),
    (
        "file",
        "class Counter:\n    def __init__(self):\n        self.counts = {}\n\n    def add(self, key):\n"
        "        self.counts[key] = self.counts.get(key, 0) + 1\n\n    def most_common(self):\n"
        "        return max(self.counts, key=self.counts.get)\n",
    ),
    (
        "quote",
        "Rivers shape the land they cross. Over thousands of years a river carves its valley, carries sand and stone "
        "to the sea, and builds wide plains where it floods. Towns grow on its banks because the water brings trade, "
        "food and power, and because a river is the oldest road there is.",
    ),
)


def sample_repeat(
    tokenizer: Any, num_requests: int, output_len: int | None = None, seed: int = 0
) -> list[SampleRequest]:
    _check_positive(num_requests=num_requests)
    if output_len is not None:
        _check_positive(output_len=output_len)
    rng = np.random.default_rng(seed)
    order: list[int] = []
    while len(order) < num_requests:  # each passage once per round, the rounds in their own seeded orders
        order.extend(int(i) for i in rng.permutation(len(REPEAT_PASSAGES)))
    requests = []
    for index in order[:num_requests]:
        kind, passage = REPEAT_PASSAGES[index]
        text = f'Here is a {kind}:\n\n"{passage}"\n\nThe same {kind} again:\n\n"'

        ids = encode(tokenizer, text)
        out = output_len if output_len is not None else len(encode(tokenizer, passage))
        requests.append(SampleRequest(text, ids, len(ids), out))
    return requests


def sample_sharegpt(
    tokenizer: Any,
    dataset_path: str,
    num_requests: int,
    output_len: int | None = None,
    seed: int = 0,
    max_model_len: int | None = None,
) -> list[SampleRequest]:
    _check_positive(num_requests=num_requests)
    if output_len is not None and output_len < 1:
        raise ValueError(f"sharegpt output length must be at least 1, got {output_len}")
    try:
        with open(dataset_path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read the ShareGPT dataset {dataset_path!r}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"ShareGPT dataset {dataset_path!r} is not valid JSON: {e}") from None
    if not isinstance(data, list):
        raise ValueError(f"ShareGPT dataset {dataset_path!r} must be a JSON list of conversations")
    rng = np.random.default_rng(seed)
    requests: list[SampleRequest] = []
    for index in rng.permutation(len(data)):
        pair = _first_exchange(data[int(index)])
        if pair is None:
            continue
        ids = encode(tokenizer, pair[0])
        out = output_len if output_len is not None else len(encode(tokenizer, pair[1]))
        if not ids or out < 1 or (max_model_len is not None and len(ids) + out > max_model_len):
            continue
        requests.append(SampleRequest(pair[0], ids, len(ids), out))
        if len(requests) == num_requests:
            break
    if not requests:
        raise ValueError(
            f"ShareGPT dataset {dataset_path!r} has no usable conversation (a human turn followed by a gpt reply"
            + (f", fitting max_model_len {max_model_len})" if max_model_len else ")")
        )
    return [requests[i % len(requests)] for i in range(num_requests)]


def _first_exchange(entry: Any) -> tuple[str, str] | None:
    """(first human turn, the gpt reply right after it), or None."""
    turns = entry.get("conversations") if isinstance(entry, dict) else None
    if not isinstance(turns, list):
        return None
    for turn, reply in zip(turns, turns[1:]):
        if not (isinstance(turn, dict) and isinstance(reply, dict)):
            return None
        if turn.get("from") in _HUMAN_ROLES:
            prompt, answer = turn.get("value"), reply.get("value")
            if reply.get("from") in _GPT_ROLES and isinstance(prompt, str) and isinstance(answer, str):
                return (prompt, answer) if prompt and answer else None
            return None
    return None


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name.replace('_', ' ')} must be at least 1, got {value}")


# ---- command line -------------------------------------------------------------------------------------------------


def add_dataset_args(parser: argparse.ArgumentParser, random_flags: bool = True) -> None:
    """The dataset flags, vLLM's names. `random_flags=False` leaves out --random-* (bench throughput keeps its own
    random workload flags)."""
    add = parser.add_argument
    add("--dataset-name", "--dataset", dest="dataset_name", choices=DATASETS, default="random", help="workload")
    add("--dataset-path", default=None, help="sharegpt: path of a ShareGPT-format JSON file")
    if random_flags:
        add("--random-input-len", "--input-len", dest="random_input_len", type=int, default=1024,
            help="random: mean prompt length in tokens (1024; --input-len is vLLM's newer name)")  # fmt: skip
        add("--random-output-len", "--output-len", dest="random_output_len", type=int, default=128,
            help="random: mean output length in tokens (128; --output-len is vLLM's newer name)")  # fmt: skip
        add("--random-prefix-len", type=int, default=0,
            help="random: tokens of one random prefix that every prompt starts with (default 0)")  # fmt: skip
        add(
            "--random-range-ratio",
            type=float,
            default=0.0,
            help="random: lengths uniform in [len*(1-r), len*(1+r)], 0 <= r < 1 (default 0: fixed lengths)",
        )
    add("--sharegpt-output-len", type=int, default=None, help="sharegpt: output length (default: the reply's)")
    add("--prefix-repetition-prefix-len", type=int, default=256, help="prefix-repetition: prefix tokens (256)")
    add("--prefix-repetition-suffix-len", type=int, default=256, help="prefix-repetition: suffix tokens (256)")
    add("--prefix-repetition-num-prefixes", type=int, default=10, help="prefix-repetition: distinct prefixes (10)")
    add("--prefix-repetition-output-len", type=int, default=128, help="prefix-repetition: output tokens (128)")
    add("--repeat-output-len", type=int, default=None, help="repeat: output tokens (default: the passage's)")


def sample_requests(
    args: argparse.Namespace, tokenizer: Any, num_requests: int, seed: int, max_model_len: int | None = None
) -> list[SampleRequest]:
    """The requests of the dataset named by `args.dataset_name` (flags from `add_dataset_args`)."""
    name = args.dataset_name
    if name == "random":
        return sample_random(
            tokenizer,
            num_requests,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            seed,
            getattr(args, "random_prefix_len", 0),
        )
    if name == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--dataset-name sharegpt needs --dataset-path (a ShareGPT-format JSON file)")
        return sample_sharegpt(
            tokenizer, args.dataset_path, num_requests, args.sharegpt_output_len, seed, max_model_len
        )
    if name == "prefix-repetition":
        return sample_prefix_repetition(
            tokenizer,
            num_requests,
            args.prefix_repetition_prefix_len,
            args.prefix_repetition_suffix_len,
            args.prefix_repetition_num_prefixes,
            args.prefix_repetition_output_len,
            seed,
        )
    if name == "repeat":
        return sample_repeat(tokenizer, num_requests, args.repeat_output_len, seed)
    raise ValueError(f"unknown dataset {name!r}; one of {', '.join(DATASETS)}")

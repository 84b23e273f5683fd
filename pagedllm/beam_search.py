"""Beam search over `LLM`, as vLLM's `LLM.beam_search`: `BeamSearchParams`, `BeamSearchSequence`, `BeamSearchOutput`.

Contract: `beam_search(llm, prompts, params)` keeps, for each prompt, the `beam_width` best sequences by score
(`beam_search_score`: the sum of their tokens' log-probabilities over their length to the power `length_penalty`, an
end-of-sequence token not counted). Each step runs every live beam as a request of one token with the top
`2 * beam_width` log-probabilities (of the model's own distribution, at `temperature`), all beams of all prompts in
one `generate` call; the prefix cache holds what the beams share, so a step computes one token a beam. A beam that
ends with the end-of-sequence token (unless `ignore_eos`) is complete; the others are complete after `max_tokens`
tokens or at the model's context length. The result of each prompt holds its `beam_width` best complete sequences,
best first; a sequence's `tokens` and `text` include the prompt (vLLM's offline beam search does the same), its
`logprobs` are those of its generated tokens. Beam search is deterministic at temperature 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedllm.outputs import Logprob

if TYPE_CHECKING:
    from pagedllm.engine.llm import LLM
    from pagedllm.lora.request import LoRARequest


@dataclass
class BeamSearchParams:
    """vLLM's beam search parameters."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be at least 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")


@dataclass
class BeamSearchSequence:
    """One sequence of a beam search: `tokens` (the prompt's, then the generated ones), the generated tokens'
    `logprobs`, their sum `cum_logprob`, and once returned its `text` and `finish_reason`."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    lora_request: LoRARequest | None = None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_search_score(
    tokens: Sequence[int], cum_logprob: float, eos_token_id: int | None, length_penalty: float
) -> float:
    """vLLM's score: the cumulative log-probability over the length (the end-of-sequence token not counted) to the
    power `length_penalty`."""
    length = len(tokens)
    if eos_token_id is not None and tokens and tokens[-1] == eos_token_id:
        length -= 1
    return cum_logprob / max(length, 1) ** length_penalty


def _prompt_ids(llm: LLM, prompt: Any) -> list[int]:
    if isinstance(prompt, str):
        return llm.input_processor.tokenize(prompt, True)
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
        return llm.input_processor.tokenize(prompt["prompt"], True)
    if isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    raise ValueError(f"a beam search prompt is a string, token ids or a prompt dict, got {type(prompt).__name__}")


def beam_search(
    llm: LLM,
    prompts: Sequence[Any],
    params: BeamSearchParams,
    lora_request: LoRARequest | None = None,
    use_tqdm: bool = False,
) -> list[BeamSearchOutput]:
    """The `params.beam_width` best sequences of each prompt (module docstring)."""
    from pagedllm.sampling_params import SamplingParams

    width = params.beam_width
    max_logprobs = llm.config.model_config.max_logprobs
    if 2 * width > max_logprobs:
        raise ValueError(
            f"beam_width {width} needs the top {2 * width} log-probabilities of each step, above --max-logprobs "
            f"{max_logprobs}"
        )
    eos = llm.input_processor.eos_token_id
    max_len = llm.config.model_config.max_model_len

    def key(beam: BeamSearchSequence) -> float:
        return beam_search_score(beam.tokens, beam.cum_logprob, eos, params.length_penalty)

    starts = [_prompt_ids(llm, p) for p in prompts]
    live = [[BeamSearchSequence(tokens=ids, lora_request=lora_request)] for ids in starts]
    done: list[list[BeamSearchSequence]] = [[] for _ in starts]
    step_params = SamplingParams(max_tokens=1, logprobs=2 * width, temperature=params.temperature)
    for _ in range(params.max_tokens):
        for i, beams in enumerate(live):  # a beam at the context length can grow no more
            done[i] += [b for b in beams if len(b.tokens) >= max_len]
            live[i] = [b for b in beams if len(b.tokens) < max_len]
        batch = [beam for beams in live for beam in beams]
        if not batch:
            break
        outs = llm.generate(
            [{"prompt_token_ids": b.tokens} for b in batch], step_params, use_tqdm=use_tqdm, lora_request=lora_request
        )
        at = 0
        for i, beams in enumerate(live):
            grown: list[BeamSearchSequence] = []
            for beam, out in zip(beams, outs[at : at + len(beams)], strict=True):
                step = out.outputs[0].logprobs[0]
                for token, lp in step.items():
                    child = BeamSearchSequence(
                        tokens=[*beam.tokens, token],
                        logprobs=[*beam.logprobs, step],
                        lora_request=lora_request,
                        cum_logprob=beam.cum_logprob + lp.logprob,
                    )
                    if token == eos and not params.ignore_eos:
                        child.finish_reason, child.stop_reason = "stop", token
                        done[i].append(child)
                    else:
                        grown.append(child)
            at += len(beams)
            live[i] = sorted(grown, key=key, reverse=True)[:width]
    results = []
    for i, beams in enumerate(live):
        best = sorted(done[i] + beams, key=key, reverse=True)[:width]
        for beam in best:
            beam.finish_reason = beam.finish_reason or "length"
            skip = beam.finish_reason == "stop" and not params.include_stop_str_in_output
            beam.text = llm.tokenizer.decode(beam.tokens[:-1] if skip else beam.tokens)
        results.append(BeamSearchOutput(sequences=best))
    return results

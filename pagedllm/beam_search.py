"""Beam search over `LLM`, as vLLM's `LLM.beam_search`: `BeamSearchSequence`, `BeamSearchOutput` (the parameters,
`BeamSearchParams`, are in sampling_params.py, where vLLM has them).

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
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from pagedllm.lora.request import LoRARequest


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


def _prompt_ids(llm: Any, prompt: Any) -> list[int]:
    """A prompt's token ids, read as `generate` reads prompts (a string is tokenized with special tokens)."""
    from pagedllm.engine.input_processor import parse_prompt

    text, ids = parse_prompt(prompt)
    return ids if ids is not None else llm.input_processor.tokenize(text, True)


class BeamSearch:
    """The search of a batch of prompts, driven from outside: `pending()` gives the token lists to run as one-token
    requests (`step_params()`), `advance()` takes each one's top log-probabilities in that order; empty `pending()`:
    done, `results()` the best sequences. Drivers: `beam_search` (LLM) and the server's (AsyncLLM)."""

    def __init__(
        self,
        starts: list[list[int]],
        params: BeamSearchParams,
        eos_token_id: int | Sequence[int] | None,
        max_model_len: int,
        max_logprobs: int,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """`eos_token_id`: the token, or the tokens, that end a sequence (the tokenizer's eos and the model's other
        end tokens: InputProcessor.eos_token_ids)."""
        if 2 * params.beam_width > max_logprobs:
            raise ValueError(
                f"beam_width {params.beam_width} needs the top {2 * params.beam_width} log-probabilities of each "
                f"step, above --max-logprobs {max_logprobs}"
            )
        self.params = params
        self.eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
        self.max_len = max_model_len
        self.lora_request = lora_request
        self.live = [[BeamSearchSequence(tokens=list(ids), lora_request=lora_request)] for ids in starts]
        self.done: list[list[BeamSearchSequence]] = [[] for _ in starts]
        self.steps = 0

    def step_params(self) -> SamplingParams:
        return SamplingParams(max_tokens=1, logprobs=2 * self.params.beam_width, temperature=self.params.temperature)

    def _key(self, beam: BeamSearchSequence) -> float:
        last = beam.tokens[-1] if beam.tokens and beam.tokens[-1] in self.eos else None
        return beam_search_score(beam.tokens, beam.cum_logprob, last, self.params.length_penalty)

    def pending(self) -> list[list[int]]:
        if self.steps >= self.params.max_tokens:
            return []
        for i, beams in enumerate(self.live):  # a beam at the context length can grow no more
            self.done[i] += [b for b in beams if len(b.tokens) >= self.max_len]
            self.live[i] = [b for b in beams if len(b.tokens) < self.max_len]
        return [beam.tokens for beams in self.live for beam in beams]

    def advance(self, steps: Sequence[dict[int, Logprob]]) -> None:
        at = 0
        for i, beams in enumerate(self.live):
            grown: list[BeamSearchSequence] = []
            for beam, step in zip(beams, steps[at : at + len(beams)], strict=True):
                for token, lp in step.items():
                    child = BeamSearchSequence(
                        tokens=[*beam.tokens, token],
                        logprobs=[*beam.logprobs, step],
                        lora_request=self.lora_request,
                        cum_logprob=beam.cum_logprob + lp.logprob,
                    )
                    if token in self.eos and not self.params.ignore_eos:
                        child.finish_reason = "stop"  # stop_reason None: the end-of-sequence token, as in outputs
                        self.done[i].append(child)
                    else:
                        grown.append(child)
            at += len(beams)
            self.live[i] = sorted(grown, key=self._key, reverse=True)[: self.params.beam_width]
        self.steps += 1

    def results(self, decode: Any, prompt_lens: Sequence[int] | None = None) -> list[BeamSearchOutput]:
        """The best complete sequences of each prompt; `text` decodes all of `tokens`, or only the generated ones
        where `prompt_lens` gives the prompts' lengths (the server's choices)."""
        out = []
        for i, beams in enumerate(self.live):
            best = sorted(self.done[i] + beams, key=self._key, reverse=True)[: self.params.beam_width]
            for beam in best:
                beam.finish_reason = beam.finish_reason or "length"
                end = len(beam.tokens)
                if beam.finish_reason == "stop" and not self.params.include_stop_str_in_output:
                    end -= 1
                beam.text = decode(beam.tokens[(prompt_lens[i] if prompt_lens else 0) : end])
            out.append(BeamSearchOutput(sequences=best))
        return out


def beam_search(
    llm: Any,
    prompts: Sequence[Any],
    params: BeamSearchParams,
    lora_request: LoRARequest | None = None,
    use_tqdm: bool = False,
) -> list[BeamSearchOutput]:
    """The `params.beam_width` best sequences of each prompt (module docstring); `llm`: an `LLM` (engine/llm.py,
    which imports this module)."""
    mc = llm.config.model_config
    search = BeamSearch(
        [_prompt_ids(llm, p) for p in prompts],
        params,
        llm.input_processor.eos_token_ids,
        mc.max_model_len,
        mc.max_logprobs,
        lora_request,
    )
    step_params = search.step_params()
    while batch := search.pending():
        outs = llm.generate(
            [{"prompt_token_ids": t} for t in batch], step_params, use_tqdm=use_tqdm, lora_request=lora_request
        )
        search.advance([out.outputs[0].logprobs[0] for out in outs])
    return search.results(llm.tokenizer.decode)

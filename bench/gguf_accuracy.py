"""A GGUF run as stored against its own de-quantization (float32): accuracy and memory, on a real file.

    python bench/gguf_accuracy.py [--model qwen2.5-coder-0.5b-q4_k_m | FILE.gguf]

Both engines in this process (engine_client="inproc"), on the same file: the as-stored one first, its resident set
growth and weight bytes against the file's tensor bytes, then `quantization="none"`. Teacher-forced over the text of
tests/engine/test_quantized.py: the fraction of positions where the two agree on the top-1 token, the perplexity
ratio and the mean |logprob difference| of the actual tokens; then both answer "The capital of France is"
(greedy, 24 tokens) and a chat question whose answer a reader can check. Prints a markdown table. Not part of CI.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-q4_k_m", help="a packaged model's name or a .gguf")
    args = parser.parse_args(argv)
    sys.path.insert(0, ROOT)
    import psutil

    from pagedllm import LLM, SamplingParams
    from pagedllm.model.gguf_file import open_gguf
    from pagedllm.model.loader import weight_bytes
    from pagedllm.model.packaged import PACKAGED_MODELS, packaged_model
    from tests.engine.test_quantized import TEXT, _teacher_forced

    path = packaged_model(args.model) if args.model in PACKAGED_MODELS else args.model
    tensor_bytes = sum(int(t.n_bytes) for t in open_gguf(path).tensors)
    engine = dict(engine_client="inproc", kv_cache_memory_bytes="128MiB", max_model_len=2048)
    before = psutil.Process().memory_info().rss
    stored = LLM(path, **engine)
    growth = psutil.Process().memory_info().rss - before
    model = stored.engine_core.engine_core.executor.worker.model_runner.model
    held = weight_bytes(model)
    reference = LLM(path, quantization="none", **engine)
    ids = stored.get_tokenizer().encode(TEXT)
    top, _, lp = _teacher_forced(stored, ids)
    r_top, _, r_lp = _teacher_forced(reference, ids)
    agreement = sum(a == b for a, b in zip(top, r_top, strict=True)) / len(top)
    ppl = math.exp(-sum(lp) / len(lp)) / math.exp(-sum(r_lp) / len(r_lp))
    diff = sum(abs(a - b) for a, b in zip(lp, r_lp, strict=True)) / len(lp)
    greedy = SamplingParams(temperature=0, max_tokens=24)
    question = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    answers = []
    for llm in (stored, reference):
        completion = llm.generate(["The capital of France is"], greedy, use_tqdm=False)[0].outputs[0].text
        try:
            chat = llm.chat(question, greedy, use_tqdm=False)[0].outputs[0].text
        except ValueError as e:  # a file without a chat template (Gemma 3 270M's)
            chat = f"(no chat: {e})"
        answers.append((completion, chat))
    print(f"\n{os.path.basename(path)}: {len(top)} positions teacher-forced\n")
    print(
        "| teacher-forced top-1 | perplexity ratio | mean abs logprob diff | weight MB | file tensor MB | "
        "weights / file | RSS growth MB |"
    )
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {agreement:.3f} | {ppl:.4f} | {diff:.4f} | {held / 1e6:.1f} | {tensor_bytes / 1e6:.1f} | "
        f"{held / tensor_bytes:.2f}x | {growth / 1e6:.0f} |"
    )
    for label, (completion, chat) in zip(("as stored", "float32"), answers, strict=True):
        print(f"\n{label}: completion {completion!r}; chat {chat!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

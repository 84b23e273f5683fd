"""Before and after for the int8 GGUF kernels: one model's linears, as stored, through two or more builds of the
native CPU kernels in one process, the builds taking turns.

    python bench/quant_kernels_ab.py BUILD.so [BUILD.so ...] [--rows 1,2,5,16,64] [--rounds 7] [--model FILE.gguf]

A build is a `pagedllm/_cpu_<isa>*.so` (of this tree, or of another one built with `setup.py build_ext --inplace`;
each must run on this CPU). For each build the script makes the model's quantized matrices from the GGUF file's own
bytes (per layer: q|k|v, o, gate|up, down; then the output head), each build its own copy, so that a decode step's
worth of weights streams from memory as in the engine, not from cache. Per row count and round, each build runs
every layer's four linears on int8 inputs (`quant_linear(..., int8=True)`, the path of decode rows) and then the
head, 5 times each; the median of 5 is that round's figure, and the line shows the median over the rounds (ms per
pass over the layers, and per head call). The outputs of the builds must be identical: the script fails when they
are not. Stop other work first: two cores are all there is.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch

from pagedllm.config import default_model_path
from pagedllm.model.gguf_file import open_gguf

LAYER_PARTS = (("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"), ("ffn_down",))


def matrices(ops: Any, path: str) -> tuple[list[Any], Any, list[int]]:
    """The model's quantized linears (layer by layer, LAYER_PARTS order), its head (the output tensor, or the tied
    embedding), and each linear's input size."""
    tensors = {t.name: t for t in open_gguf(path).tensors}

    def make(names: list[str]) -> tuple[Any, int]:
        parts = [tensors[n] for n in names]
        data = [torch.from_numpy(t.data.copy()).view(torch.uint8).reshape(int(t.shape[1]), -1) for t in parts]
        return ops.quant_matrix([int(t.tensor_type) for t in parts], data, int(parts[0].shape[0])), int(
            parts[0].shape[0]
        )

    layers, ins = [], []
    block = 0
    while f"blk.{block}.attn_q.weight" in tensors:
        for names in LAYER_PARTS:
            m, n = make([f"blk.{block}.{name}.weight" for name in names])
            layers.append(m)
            ins.append(n)
        block += 1
    head, _ = make(["output.weight" if "output.weight" in tensors else "token_embd.weight"])
    return layers, head, ins


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("builds", nargs="+", help="paths of kernel builds (.so)")
    parser.add_argument("--rows", default="1,2,5,16,64")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    parser.add_argument("--num-threads", type=int, default=2)
    args = parser.parse_args()
    import pagedllm._C as C

    torch.set_num_threads(args.num_threads)
    path = args.model or str(default_model_path())
    builds = []
    for i, so in enumerate(args.builds):
        ops = C.CpuOps(so)
        builds.append((f"{i + 1}:{so.rsplit('/', 1)[-1]}", ops, *matrices(ops, path)))  # two builds may share a name
    print(f"model {path}; builds: {', '.join(b[0] for b in builds)}; {args.num_threads} threads")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {n: torch.randn(rows, n) for n in set(builds[0][4])}
        outs = []
        for _, ops, layers, head, ins in builds:
            outs.append([ops.quant_linear(xs[n], m, None, True) for m, n in zip(layers, ins)])
            outs[-1].append(ops.quant_linear(xs[ins[0]], head, None, True))
        same = all(torch.equal(a, b) for other in outs[1:] for a, b in zip(outs[0], other))
        times: dict[str, tuple[list[float], list[float]]] = {b[0]: ([], []) for b in builds}
        for _ in range(args.rounds):
            for name, ops, layers, head, ins in builds:

                def run_layers(ops=ops, layers=layers, ins=ins, xs=xs) -> None:
                    for m, n in zip(layers, ins):
                        ops.quant_linear(xs[n], m, None, True)

                def run_head(ops=ops, head=head, n=ins[0], xs=xs) -> None:
                    ops.quant_linear(xs[n], head, None, True)

                for fn, store in ((run_layers, times[name][0]), (run_head, times[name][1])):
                    fn()
                    ts = []
                    for _ in range(5):
                        t0 = time.perf_counter()
                        fn()
                        ts.append(time.perf_counter() - t0)
                    store.append(statistics.median(ts))
        cells = "  ".join(
            f"{name}: layers {statistics.median(a) * 1e3:6.2f} head {statistics.median(b) * 1e3:5.2f} ms"
            for name, (a, b) in times.items()
        )
        print(f"rows {rows:3d}: {cells}  (outputs identical: {same})", flush=True)
        if not same:
            sys.exit("the builds' outputs differ")


if __name__ == "__main__":
    main()

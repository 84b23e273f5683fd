"""The quantized-weight kernels (csrc/cpu/quant.cpp), once per ISA build this CPU runs, for every GGML type they
run: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS, on weights quantized as
llama.cpp quantizes (tests/quant_utils.py: signed scales where llama.cpp's are signed) and on blocks of random bytes
(every bit pattern a block can hold: negative scales, all sub-block scales and mins), at widths that are and are
not multiples of 256.

* `dequantize_rows` equals the `gguf` package's reference de-quantization (to float32 rounding).
* `quant_linear` against x @ dequantize(W)^T in float64. The kernels quantize each input row to int8 in blocks of 32
  (as ggml does), so the stated tolerance is that rounding's own bound: each input within half a step (max|block| /
  254) of its value, so |error| <= sum over blocks of max|x_block| / 254 * sum |w| over the block, plus float32
  rounding. The test fails when a kernel misreads a byte, a scale or a sign, which moves results far past it.
* A row's result does not depend on how many rows share the call (batch invariance).
* Mixed segments (a merged q|k|v of several types), a bias, and the checks on bad input.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.model.quant import type_name
from tests.quant_utils import (
    IQ4_NL,
    IQ4_XS,
    Q3_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    TYPES,
    block_size,
    dequantize,
    quantize,
)

NAMES = {t: type_name(t) for t in TYPES}
# Byte offsets of each type's float16 fields within its block (the rest of a block is integers and bit fields).
F16_FIELDS = {2: [0], 3: [0, 2], 6: [0], 7: [0, 2], 8: [0], 10: [80, 82], 11: [108], 12: [0, 2], 13: [0, 2]}
F16_FIELDS |= {14: [208], 20: [0], 23: [0], 39: []}
# Byte offsets of E8M0 exponents (MXFP4's block scale 2^(e - 127)): set to the range real weights have.
E8M0_FIELDS = {39: [0]}


@pytest.fixture
def ops(isa_ops):
    return isa_ops


def _matrix(ops, types_rows: list[tuple[int, int]], cols: int, seed: int = 0):
    """A QuantMatrix of segments (type, rows) of random weights, and its reference float32 W."""
    rng = np.random.default_rng(seed)
    parts, refs = [], []
    for qtype, rows in types_rows:
        q = quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.1, qtype)
        parts.append(torch.from_numpy(q))
        refs.append(dequantize(q, qtype, (rows, cols)))
    qm = ops.quant_matrix([t for t, _ in types_rows], parts, cols)
    return qm, np.concatenate(refs)


def _bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Worst-case error of quantizing x's blocks of 32 to int8, for every output [M, O]."""
    step = np.abs(x).reshape(x.shape[0], -1, 32).max(-1) / 254
    return np.einsum("mb,obk->mo", step, np.abs(w).reshape(w.shape[0], -1, 32))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: NAMES[t])
def test_dequantize_rows_is_the_reference(ops, qtype: int) -> None:
    qm, w = _matrix(ops, [(qtype, 37)], 512)
    ids = torch.tensor([[5, 0], [36, 5]])
    got = ops.dequantize_rows(qm, ids)
    assert got.shape == (2, 2, 512)
    np.testing.assert_allclose(got.numpy(), w[ids.numpy()], rtol=1e-6, atol=1e-7)


def _random_blocks(qtype: int, rows: int, cols: int, seed: int) -> np.ndarray:
    """uint8 [rows, row_bytes] of random blocks: random bytes, the float16 fields set to small normal values."""
    rng = np.random.default_rng(seed)
    weights, nbytes = block_size(qtype)
    blocks = rng.integers(0, 256, size=(rows, cols // weights, nbytes), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        d = (rng.standard_normal(blocks.shape[:2]) * 0.002).astype(np.float16)
        blocks[:, :, at : at + 2] = d.view(np.uint8).reshape(*blocks.shape[:2], 2)
    for at in E8M0_FIELDS.get(qtype, []):
        blocks[:, :, at] = rng.integers(112, 124, size=blocks.shape[:2])  # scales 2^-15 .. 2^-4
    return blocks.reshape(rows, -1)


def _width(qtype: int) -> int:
    """A width as real models have it: 896 (Qwen2.5-0.5B's hidden size, not a multiple of 256) for the types of
    32-weight blocks, 1792 (7 x 256) for those of 256."""
    return 896 if block_size(qtype)[0] == 32 else 1792


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: NAMES[t])
def test_random_blocks_against_the_reference(ops, qtype: int) -> None:
    """Blocks of random bytes hold every value a block can: negative and positive scales, every sub-block scale,
    min and high bit. De-quantized rows are the gguf package's bit for bit; products of 1, 3 and 40 rows (int8 and
    panels) are within the int8 bound of the reference product."""
    cols = _width(qtype)
    q = _random_blocks(qtype, 40, cols, seed=qtype)
    w = dequantize(q, qtype, (40, cols))
    qm = ops.quant_matrix([qtype], [torch.from_numpy(q)], cols)
    np.testing.assert_array_equal(ops.dequantize_rows(qm, torch.arange(40)).numpy(), w)
    for rows in (1, 3, 40):
        x = np.random.default_rng(rows).standard_normal((rows, cols)).astype(np.float32)
        ref = x.astype(np.float64) @ w.T.astype(np.float64)
        for int8 in (True, False):
            got = ops.quant_linear(torch.from_numpy(x), qm, None, int8).numpy()
            slack = 2.0**-8 * (np.abs(x) @ np.abs(w).T) + 1e-6  # bf16 panels round both factors
            assert np.all(np.abs(got - ref) <= _bound(x, w) + slack), (rows, int8)
            assert np.linalg.norm(got - ref) < 0.03 * np.linalg.norm(ref), (rows, int8)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: NAMES[t])
def test_widths_of_real_models(ops, qtype: int) -> None:
    """Quantized as llama.cpp does, at a width real models have (896 is no multiple of 256): de-quantization exact,
    and products of 1, 2, 5 and 40 rows within the int8 bound."""
    cols = _width(qtype)
    qm, w = _matrix(ops, [(qtype, 50)], cols, seed=21)
    np.testing.assert_allclose(ops.dequantize_rows(qm, torch.arange(50)).numpy(), w, rtol=1e-6, atol=1e-7)
    for rows in (1, 2, 5, 40):
        x = np.random.default_rng(rows).standard_normal((rows, cols)).astype(np.float32)
        ref = x.astype(np.float64) @ w.T.astype(np.float64)
        got = ops.quant_linear(torch.from_numpy(x), qm).numpy()
        assert np.all(np.abs(got - ref) <= _bound(x, w) + 2.0**-8 * (np.abs(x) @ np.abs(w).T) + 1e-6), rows
        assert np.linalg.norm(got - ref) < 0.03 * np.linalg.norm(ref), rows


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: NAMES[t])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 17, 70])
def test_quant_linear_within_the_int8_input_bound(ops, qtype: int, rows: int) -> None:
    qm, w = _matrix(ops, [(qtype, 45)], 768, seed=rows)
    x = np.random.default_rng(100 + rows).standard_normal((rows, 768)).astype(np.float32)
    x[0, :32] *= 50  # one block of large values: its own scale must not leak into the others
    got = ops.quant_linear(torch.from_numpy(x), qm).numpy()
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    slack = 1e-5 * (np.abs(x) @ np.abs(w).T) + 1e-6
    assert np.all(np.abs(got - ref) <= _bound(x, w) + slack)
    # and the error is the rounding's, not a systematic one: well inside the bound on average
    assert np.linalg.norm(got - ref) < 0.05 * np.linalg.norm(ref)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: NAMES[t])
def test_a_rows_result_does_not_depend_on_the_batch(ops, qtype: int) -> None:
    """Up to quant_dot_max_rows rows (decode steps) a row's int8 product is the same in any batch; beyond, the
    de-quantized panels give the product up to float32 rounding, or bf16 rounding of both factors where the build
    multiplies in bf16 (relative 2^-9 each)."""
    qm, w = _matrix(ops, [(qtype, 33)], 512)
    top = ops.quant_dot_max_rows()
    assert top >= 4
    x = torch.randn(top, 512, generator=torch.Generator().manual_seed(1))
    whole = ops.quant_linear(x, qm)
    for m in range(top):
        assert torch.equal(ops.quant_linear(x[m : m + 1].contiguous(), qm)[0], whole[m])
    assert torch.equal(ops.quant_linear(x[3:9].contiguous(), qm), whole[3:9])
    many = torch.cat([x] * max(2, -(-33 // top)))  # past the int8 path: the de-quantized weight's panels
    wd = torch.from_numpy(w).double()
    ref = many.double() @ wd.T
    got = ops.quant_linear(many, qm).double()
    if ops.bf16_native():
        bound = 2.0**-8 * 1.01 * (many.abs().double() @ wd.abs().T) + 1e-5
        assert torch.all((got - ref).abs() <= bound)
        # bf16 panels: a row's result is the same in any batch of more than quant_dot_max_rows rows
        assert torch.equal(ops.quant_linear(many[1:].contiguous(), qm), got[1:].float())
    else:
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: NAMES[t])
def test_panel_rows_are_the_same_in_any_batch(ops, qtype: int) -> None:
    """Prompt rows (no int8) run on panels, in tiles and blocks of rows and in slices of the input: a row's result is
    bit for bit the same whatever rows share the call, across tiles and partial blocks too (150 rows of 1536 inputs
    are several tiles), bias included. (Weights kept as stored take few rows in int8 whatever the flag: there, only
    calls of more than quant_dot_max_rows rows run on panels.)"""
    qm, w = _matrix(ops, [(qtype, 48)], 1536, seed=7)
    gen = torch.Generator().manual_seed(3)
    x, bias = torch.randn(150, 1536, generator=gen), torch.randn(48, generator=gen)
    whole = ops.quant_linear(x, qm, bias, False)
    least = 1 if qm.packed_rows == 48 else ops.quant_dot_max_rows() + 1
    for lo, hi in ((0, 1), (5, 12), (1, 150), (149, 150), (37, 120), (100, 150)):
        if hi - lo >= least:
            assert torch.equal(ops.quant_linear(x[lo:hi].contiguous(), qm, bias, False), whole[lo:hi]), (lo, hi)
    wd = torch.from_numpy(w).double()
    ref = x.double() @ wd.T + bias.double()
    if ops.bf16_native():  # both factors rounded to bf16 (relative 2^-9 each), as in the test above
        bound = 2.0**-8 * 1.01 * (x.abs().double() @ wd.abs().T) + 1e-5
        assert torch.all((whole.double() - ref).abs() <= bound)
    else:
        torch.testing.assert_close(whole.double(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: NAMES[t])
def test_panels_are_those_of_the_dequantized_rows(ops, qtype: int) -> None:
    """A prompt row's product is the same bits whether its panels were written straight from the packed groups (the
    packed types on SIMD builds) or from rows de-quantized first (the others, and the unpacked tail rows): both hold
    the rows' values (rounded to bf16 where the build multiplies in bf16), and the same kernel sums them. Checked
    against panels packed from `dequantize_rows`' float32 rows, with a width that is not a multiple of 256 where the
    type allows."""
    cols = 256 * 3 if block_size(qtype)[0] == 256 else 32 * 29
    qm, _ = _matrix(ops, [(qtype, 70)], cols, seed=13)  # 64 rows in packed groups, 6 as stored
    rows = ops.dequantize_rows(qm, torch.arange(70))
    x = torch.randn(40, cols, generator=torch.Generator().manual_seed(2))
    if ops.bf16_native():
        want = ops.bf16_panel_linear(x, ops.bf16_pack_panels(rows), None, 70)
    else:
        want = ops.panel_linear(x, ops.pack_panels(rows), None, 70)
    assert torch.equal(ops.quant_linear(x, qm, None, False), want)


@pytest.mark.parametrize("qtype", (Q4_0, Q8_0, Q4_K), ids=lambda t: NAMES[t])
def test_many_panel_rows_in_blocks_are_the_same_bits(ops, qtype: int) -> None:
    """Prompt rows beyond about 768 KiB of inputs go in row blocks against panels de-quantized a group at a time
    (16 MiB of panels a group): 300 rows of 3,072 inputs are 3-5 blocks on every build, and 2,800 outputs two
    groups of bf16 panels (three of float32 ones). A row's result is the same bits whether its call was blocked
    (other block boundaries too) or small enough not to be, bias included, and within the product's rounding."""
    qm, w = _matrix(ops, [(qtype, 2800)], 3072, seed=11)
    gen = torch.Generator().manual_seed(5)
    x, bias = torch.randn(300, 3072, generator=gen), torch.randn(2800, generator=gen)
    whole = ops.quant_linear(x, qm, bias, False)
    for lo, hi in ((0, 40), (37, 101), (250, 300), (37, 300), (1, 299)):
        assert torch.equal(ops.quant_linear(x[lo:hi].contiguous(), qm, bias, False), whole[lo:hi]), (lo, hi)
    rows = [0, 77, 150, 299]
    wd = torch.from_numpy(w).double()
    ref = x[rows].double() @ wd.T + bias.double()
    bound = (2.0**-8 * 1.01 if ops.bf16_native() else 1e-5) * (x[rows].abs().double() @ wd.abs().T) + 1e-5
    assert torch.all((whole[rows].double() - ref).abs() <= bound)


# The types AVX2 and AVX-512 builds keep in their interleaved layout (all but Q2_K and MXFP4).
PACKED = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS)


def _packs(ops) -> bool:
    return ops.isa != "generic"  # AVX2 (vpmaddubsw) or AVX-512 (vpdpbusd with VNNI, else the AVX2 kernel)


def _packed_types(ops) -> tuple[int, ...]:
    """The types a SIMD build keeps in its interleaved layout."""
    if not _packs(ops):
        return ()
    return PACKED


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: NAMES[t])
def test_packed_layout_where_the_build_has_one(ops, qtype: int) -> None:
    """SIMD builds rewrite the PACKED types' rows in groups of 16 (the rest stay as stored); generic keeps all."""
    qm, w = _matrix(ops, [(qtype, 37)], 512)
    assert qm.packed_rows == (32 if qtype in _packed_types(ops) else 0)
    assert qm.nbytes == 37 * ops.quant_row_bytes(qtype, 512)  # in place: no byte more
    np.testing.assert_allclose(ops.dequantize_rows(qm, torch.arange(37)).numpy(), w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: NAMES[t])
def test_int8_inputs_for_any_number_of_rows(ops, qtype: int) -> None:
    """With int8 (decode steps), a wholly packed weight runs every row on int8 products, each row's result the same
    in any batch and within the int8 bound; a weight that is not (another type or build, or a partial group of 16
    rows) runs more than quant_dot_max_rows rows on panels, as without int8. In the amx case rows 0-63 of the 70 go
    16 at a time through the AMX int8 tiles (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), the single rows through VNNI: equal bit
    for bit."""
    qm, w = _matrix(ops, [(qtype, 48)], 512, seed=9)
    x = torch.randn(70, 512, generator=torch.Generator().manual_seed(2))
    got = ops.quant_linear(x, qm, None, True)
    if qm.packed_rows == 48:
        for m in (0, 33, 69):
            assert torch.equal(ops.quant_linear(x[m : m + 1].contiguous(), qm, None, True)[0], got[m])
        assert torch.equal(ops.quant_linear(x[5:30].contiguous(), qm, None, True), got[5:30])
        ref = x.double().numpy() @ w.T.astype(np.float64)
        xn = x.numpy()
        assert np.all(np.abs(got.numpy() - ref) <= _bound(xn, w) + 1e-5 * (np.abs(xn) @ np.abs(w).T) + 1e-6)
        panels = ops.quant_linear(x, qm)
        assert not torch.equal(got, panels)  # without int8: the panels, for any number of rows
        assert torch.equal(ops.quant_linear(x[7:9].contiguous(), qm), panels[7:9])
    else:
        assert qtype not in _packed_types(ops)
        assert torch.equal(got, ops.quant_linear(x, qm))


def test_row_kinds_mark_rows_of_a_step(ops) -> None:
    """The step plan's RowKinds: each marked row as int8 alone gives it, each other row as the panels do; a
    quantized weight given no row kinds is an error, not a silent choice."""
    from pagedllm.model.layers.linear import GENERATED_ROWS, RowKinds, linear

    qm, _ = _matrix(ops, [(Q4_1, 48)], 512, seed=11)
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(3))
    mask = torch.tensor([True, False, False, True, True, False, True, False, False])
    kinds = RowKinds(mask)
    got = linear(x, torch.empty(0), qweight=qm, ops=ops, rows=kinds)
    with pytest.raises(ValueError, match="mark 9 rows, the linear got 2"):
        linear(x[:2], torch.empty(0), qweight=qm, ops=ops, rows=kinds)
    with pytest.raises(ValueError, match="needs the kinds of its input rows"):
        linear(x, torch.empty(0), qweight=qm, ops=ops)
    for m in range(9):
        assert torch.equal(got[m], ops.quant_linear(x[m : m + 1].contiguous(), qm, None, bool(mask[m]))[0])
    # a selection and a split keep each row's kind
    pick = torch.tensor([6, 1, 3])
    assert torch.equal(linear(x[pick], torch.empty(0), qweight=qm, ops=ops, rows=kinds.select(pick)), got[pick])
    parts = [linear(c, torch.empty(0), qweight=qm, ops=ops, rows=k) for c, k in zip(x.split(4), kinds.split(4))]
    assert torch.equal(torch.cat(parts), got)
    every = RowKinds(torch.ones(9, dtype=torch.bool))
    want = ops.quant_linear(x, qm, None, True)
    assert torch.equal(linear(x, torch.empty(0), qweight=qm, ops=ops, rows=every), want)
    assert torch.equal(linear(x, torch.empty(0), qweight=qm, ops=ops, rows=GENERATED_ROWS), want)


@pytest.mark.parametrize("rows", [33, 48], ids=["partly-packed", "packed"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: NAMES[t])
def test_many_rows_are_the_bf16_product_of_the_dequantized_weight(ops, qtype: int, rows: int) -> None:
    """Many rows run on panels de-quantized from the blocks: where the build multiplies in bf16, bf16 panels made
    straight from the blocks, the same result bit for bit as packing the float32 de-quantized weight into bf16
    panels (a whole panel and a partial one; inputs longer than a panel slice); elsewhere float32 panels, the
    float32 panel product of the de-quantized weight. Packed rows de-quantize alike."""
    qm, _ = _matrix(ops, [(qtype, rows)], 768, seed=5)
    dense = ops.dequantize_rows(qm, torch.arange(rows))
    x = torch.randn(3 * ops.quant_dot_max_rows() + 5, 768)
    if ops.bf16_native():
        assert torch.equal(ops.quant_linear(x, qm), ops.bf16_panel_linear(x, ops.bf16_pack_panels(dense), None, rows))
    else:
        torch.testing.assert_close(ops.quant_linear(x, qm), ops.panel_linear(x, ops.pack_panels(dense), None, rows))


def test_mixed_segments_and_bias(ops) -> None:
    qm, w = _matrix(ops, [(Q4_K, 20), (Q6_K, 9), (Q6_K, 7), (Q8_0, 3)], 512, seed=3)
    assert (qm.out_features, qm.in_features) == (39, 512)
    x = np.random.default_rng(4).standard_normal((6, 512)).astype(np.float32)
    bias = torch.randn(39)
    got = ops.quant_linear(torch.from_numpy(x), qm, bias).numpy()
    ref = x.astype(np.float64) @ w.T.astype(np.float64) + bias.numpy()
    assert np.all(np.abs(got - ref) <= _bound(x, w) + 1e-5 * (np.abs(x) @ np.abs(w).T) + 1e-5)
    np.testing.assert_allclose(ops.dequantize_rows(qm, torch.arange(39)).numpy(), w, rtol=1e-6, atol=1e-7)


def test_row_bytes_per_type(ops) -> None:
    assert ops.quant_row_bytes(Q4_1, 576) == 18 * 20
    assert ops.quant_row_bytes(Q8_0, 64) == 2 * 34
    assert ops.quant_row_bytes(Q6_K, 512) == 2 * 210
    assert ops.quant_row_bytes(Q4_K, 576) == 0  # not a whole number of 256-weight blocks
    assert ops.quant_row_bytes(6, 896) == 28 * 22  # Q5_0
    assert ops.quant_row_bytes(10, 768) == 3 * 84  # Q2_K
    assert ops.quant_row_bytes(11, 768) == 3 * 110  # Q3_K
    assert ops.quant_row_bytes(20, 96) == 3 * 18  # IQ4_NL
    assert ops.quant_row_bytes(23, 512) == 2 * 136  # IQ4_XS
    assert ops.quant_row_bytes(23, 896) == 0
    assert ops.quant_row_bytes(1, 64) == 0  # F16: no quantized kernel (linears run it on bf16 panels)
    assert ops.quant_row_bytes(16, 256) == 0  # IQ2_XXS: none
    assert ops.quant_row_bytes(Q4_0, 0) == 0


def test_bad_input_is_refused(ops) -> None:
    q = torch.from_numpy(quantize(np.ones((4, 64), np.float32), Q4_0))
    with pytest.raises(RuntimeError, match=r"must be \[rows, 36\]"):
        ops.quant_matrix([Q4_0], [q[:, :30].contiguous()], 64)
    with pytest.raises(RuntimeError, match="no kernel for GGML type 1"):
        ops.quant_matrix([1], [q], 64)
    with pytest.raises(RuntimeError, match="one to 4 segments"):
        ops.quant_matrix([Q4_0] * 5, [q] * 5, 64)
    with pytest.raises(RuntimeError, match="uint8"):
        ops.quant_matrix([Q4_0], [q.float()], 64)
    qm = ops.quant_matrix([Q4_0], [q], 64)
    with pytest.raises(RuntimeError, match=r"x must be \[M, 64\]"):
        ops.quant_linear(torch.randn(2, 32), qm)
    with pytest.raises(RuntimeError, match="row id 4 out of range"):
        ops.dequantize_rows(qm, torch.tensor([4]))

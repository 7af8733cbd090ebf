"""Block-wise int8 / NF4 quantization of frozen weights (jaxzero.models.quant): error bounds
per block, bitsandbytes' NF4 codebook and nibble order, JAX == numpy bit for bit (jit too),
zero blocks, refusals, and the byte accounting against what quantize returns."""

from __future__ import annotations

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxzero.models import quant
from jaxzero.models.quant import (
    BLOCK,
    KINDS,
    NF4,
    bytes_per_param,
    dequantize,
    dequantize_np,
    quantize,
    quantized_shapes,
)

# bitsandbytes-foundation/bitsandbytes, bitsandbytes/functional.py, get_4bit_type("nf4")
# (commit 95f9af309d4d5793847169c39288dcd3fcbdf564): the float32 values as Python prints them
BNB_NF4 = [
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
]


def _weight(shape=(3, 16, 256), seed=0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * 0.02).astype(np.float32)


def _nearest(x: np.ndarray) -> np.ndarray:
    """Index of the codebook value nearest to each x, ties to the lower index: brute force,
    in float64, where the differences of these float32 values are exact."""
    d = np.abs(x.astype(np.float64)[..., None] - NF4.astype(np.float64))
    return np.argmin(d, axis=-1)  # argmin: the first of equal minima, the lower index


def _unpack(codes: np.ndarray) -> np.ndarray:
    out = np.empty((*codes.shape[:-1], codes.shape[-1] * 2), np.uint8)
    out[..., 0::2], out[..., 1::2] = codes >> 4, codes & 0xF
    return out


def test_round_trip_error_is_within_half_a_step_in_every_block():
    w = _weight()
    blocks = w.reshape(3, 16, 256 // BLOCK, BLOCK)
    absmax = np.abs(blocks).max(axis=-1)
    gap = np.max(np.diff(NF4.astype(np.float64)))  # 1 - 0.7229568...
    bound = {"int8": 0.5 * absmax / 127, "nf4": 0.5 * gap * absmax}
    for kind in KINDS:
        q = quantize(w, kind)
        np.testing.assert_array_equal(q["scale"], absmax)
        err = np.abs(dequantize_np(q, kind) - w).reshape(blocks.shape).max(axis=-1)
        # 1e-4 of the bound: float32 rounding of the divisions and products, far less than
        # one wrong code (a whole step: twice the int8 bound)
        ratio = err / bound[kind]
        assert ratio.max() <= 1 + 1e-4, (kind, ratio.max())
        rel_rms = np.sqrt(np.mean((dequantize_np(q, kind) - w) ** 2) / np.mean(w**2))
        print(
            f"{kind}: relative RMS error {rel_rms:.4%}, worst block error/bound {ratio.max():.3f}"
        )
        assert {"int8": 0.003 < rel_rms < 0.009, "nf4": 0.07 < rel_rms < 0.12}[kind]
    # nf4: every code is the nearest codebook value of w / absmax, not merely within bound
    x = blocks / absmax[..., None]
    codes = _unpack(quantize(w, "nf4")["codes"]).reshape(x.shape)
    np.testing.assert_array_equal(codes, _nearest(x))


def test_nf4_codebook_is_bitsandbytes_values_exactly():
    assert NF4.dtype == np.float32 and NF4.shape == (16,)
    np.testing.assert_array_equal(NF4, np.array(BNB_NF4, np.float32))
    assert NF4.astype(np.float64).tolist() == BNB_NF4  # the printed values are float32 ones
    assert {0.0, 1.0, -1.0} <= set(NF4.tolist())
    assert np.all(np.diff(NF4) > 0)


def test_nf4_nearest_at_the_midpoints_ties_go_to_the_lower_index():
    """float32 points at, just below and just above each midpoint between codebook values
    (a block holding 1.0, so w / absmax is w exactly) get the nearest code; an exact tie
    the lower one."""
    c = NF4.astype(np.float64)
    mid = np.float32((c[:-1] + c[1:]) / 2)
    pts = np.concatenate(
        [mid, np.nextafter(mid, np.float32(-2)), np.nextafter(mid, np.float32(2)), NF4]
    )
    w = np.zeros((1, 2 * BLOCK), np.float32)
    w[0, : pts.size] = pts
    w[0, -1] = 1.0
    w[0, BLOCK - 1] = 1.0
    codes = _unpack(quantize(w, "nf4")["codes"])[0]
    np.testing.assert_array_equal(codes[: pts.size], _nearest(pts))
    np.testing.assert_array_equal(codes[3 * 15 : 3 * 15 + 16], np.arange(16))
    ties = np.float64(mid) == (c[:-1] + c[1:]) / 2  # midpoints float32 can hold exactly
    assert ties.any()  # ... so the tie rule is exercised
    np.testing.assert_array_equal(codes[:15][ties], np.arange(15)[ties])


def test_nf4_packs_element_2k_in_the_high_nibble():
    idx = np.array([list(range(16)) * 4, [15 - i for i in range(16)] * 4])
    w = (2 * NF4[idx]).astype(np.float32)  # absmax 2: w / 2 is a codebook value exactly
    q = quantize(w, "nf4")
    assert q["codes"].dtype == np.uint8 and q["codes"].shape == (2, 32)
    expected = [
        [0x01, 0x23, 0x45, 0x67, 0x89, 0xAB, 0xCD, 0xEF] * 4,
        [0xFE, 0xDC, 0xBA, 0x98, 0x76, 0x54, 0x32, 0x10] * 4,
    ]
    np.testing.assert_array_equal(q["codes"], np.array(expected, np.uint8))
    np.testing.assert_array_equal(q["scale"], [[2.0], [2.0]])
    np.testing.assert_array_equal(dequantize_np(q, "nf4"), w)
    np.testing.assert_array_equal(np.asarray(dequantize(q, "nf4")), w)


def test_int8_rounds_half_to_even():
    w = np.zeros((1, BLOCK), np.float32)
    halves = [127, -127, 63.5, 0.5, 1.5, 2.5, -2.5, -0.5, 3.5, 126.5, 0.4, -0.6]
    w[0, : len(halves)] = halves  # absmax 127: w / 127 * 127 is w again for these
    q = quantize(w, "int8")
    assert q["codes"].dtype == np.int8 and q["scale"].tolist() == [[127.0]]
    expected = [127, -127, 64, 0, 2, 2, -2, 0, 4, 126, 0, -1]
    assert q["codes"][0, : len(halves)].tolist() == expected


@pytest.mark.parametrize("kind", KINDS)
def test_jax_dequantize_equals_numpy_bit_for_bit(kind):
    jitted = jax.jit(dequantize, static_argnums=(1, 2, 3))
    for shape in [(3, 16, 256), (16, 128)]:  # a stacked (L, out, in) weight, one layer's
        q = quantize(_weight(shape, seed=len(shape)), kind)
        ref = dequantize_np(q, kind)
        assert ref.dtype == np.float32 and ref.shape == shape
        for got in (dequantize(q, kind), jitted(q, kind, jnp.float32, BLOCK)):
            assert got.dtype == jnp.float32 and got.shape == shape
            assert np.array_equal(np.asarray(got), ref), (kind, shape)
        bf16 = jitted(q, kind, jnp.bfloat16, BLOCK)
        assert bf16.dtype == jnp.bfloat16
        assert np.array_equal(np.asarray(bf16), ref.astype(jnp.bfloat16))
    # one layer of a stacked weight, sliced inside the step, is that layer's weight
    q = quantize(_weight(), kind)
    layer = jax.jit(lambda q, i: dequantize(jax.tree.map(lambda a: a[i], q), kind))
    assert np.array_equal(np.asarray(layer(q, 1)), dequantize_np(q, kind)[1])
    # another block size, given to both sides
    q = quantize(_weight((4, 256)), kind, block=128)
    assert q["scale"].shape == (4, 2)
    got = jitted(q, kind, jnp.float32, 128)
    assert np.array_equal(np.asarray(got), dequantize_np(q, kind, block=128))


@pytest.mark.parametrize("kind, zero_code", [("int8", 0), ("nf4", 0x77)])
def test_a_block_of_zeros_has_scale_0_and_decodes_to_0(kind, zero_code):
    """nf4's code of 0.0 is index 7 (byte 0x77); int8's is 0."""
    w = _weight((2, 3 * BLOCK))
    w[1, BLOCK : 2 * BLOCK] = 0.0
    w[1, BLOCK] = -0.0
    q = quantize(w, kind)
    assert q["scale"][1, 1] == 0 and np.all(q["scale"][[0, 1], [1, 0]] > 0)
    per = BLOCK if kind == "int8" else BLOCK // 2
    assert np.all(q["codes"][1, per : 2 * per] == zero_code)
    for out in (dequantize_np(q, kind), np.asarray(jax.jit(dequantize, static_argnums=1)(q, kind))):
        assert np.all(np.isfinite(out))
        np.testing.assert_array_equal(out[1, BLOCK : 2 * BLOCK], 0.0)
    all_zero = quantize(np.zeros((4, BLOCK), np.float32), kind)
    np.testing.assert_array_equal(dequantize(all_zero, kind), np.zeros((4, BLOCK)))


def _one_line_error(fn, *words):
    with pytest.raises(ValueError) as info:
        fn()
    message = str(info.value)
    assert "\n" not in message, message
    for word in words:
        assert word in message, (word, message)


def test_refusals_are_one_line_value_errors():
    _one_line_error(lambda: quantize(np.ones((3, 100), np.float32), "int8"), "(3, 100)", "64")
    _one_line_error(lambda: quantize(np.ones((3, 96)), "nf4", block=32 + 1), "even", "33")
    _one_line_error(lambda: quantized_shapes((8, 100), "nf4"), "(8, 100)", "64")
    _one_line_error(lambda: quantize(np.ones((2, 64)), "int4"), "'int4'", "int8, nf4")
    _one_line_error(lambda: bytes_per_param("fp8"), "'fp8'")
    _one_line_error(lambda: quantize(np.ones((2, 64)), "int8", block=0), "block")
    w = np.ones((2, 64), np.float32)
    w[1, 3] = np.nan
    _one_line_error(lambda: quantize(w, "int8"), "(2, 64)", "NaN")
    q = quantize(np.ones((2, 128), np.float32), "int8")
    _one_line_error(lambda: dequantize(q, "int8", block=32), "(2, 2)", "(2, 4)")
    _one_line_error(lambda: dequantize_np(q, "int8", block=32), "(2, 2)", "(2, 4)")


@pytest.mark.parametrize("kind, block", [("int8", 64), ("nf4", 64), ("int8", 32), ("nf4", 128)])
def test_accounting_agrees_with_what_quantize_returns(kind, block):
    w = _weight((2, 8, 256))
    q = quantize(w, kind, block)
    assert sum(a.nbytes for a in q.values()) / w.size == bytes_per_param(kind, block)
    planned = quantized_shapes(w.shape, kind, block)
    assert planned.keys() == q.keys()
    for name, a in q.items():
        assert (planned[name].shape, planned[name].dtype) == (a.shape, a.dtype), name
    assert isinstance(planned["codes"], jax.ShapeDtypeStruct)
    # dequantize traced from the planned shapes alone gives the weight's shape
    out = jax.eval_shape(lambda q: dequantize(q, kind, jnp.bfloat16, block), planned)
    assert (out.shape, out.dtype) == (w.shape, jnp.bfloat16)


def test_bytes_per_param_formula():
    assert bytes_per_param("int8") == 1 + 4 / 64 == 1.0625
    assert bytes_per_param("nf4") == 0.5 + 4 / 64 == 0.5625
    assert bytes_per_param("nf4", 256) == 0.515625


def test_docstring_example_runs():
    result = doctest.testmod(quant, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0

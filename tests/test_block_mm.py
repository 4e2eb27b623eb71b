"""The ``block_mm`` CPU kernel (``specdec.core.kernels``): it equals the matmul of the 8-bit-quantized
activations with the dequantized weight, a row's output is bitwise the same whatever the number of rows in
the call, every instruction-set path gives the same bits, and the packed layout round-trips."""
import pytest
import torch

from specdec.core.block_linear import KINDS, BlockLinear
from specdec.core.gguf_weights import BlockWeights
from specdec.core.kernels import (
    block_mm_isa,
    block_mm_prefetch,
    dequantize,
    load_block_mm,
    quantize_activations,
    set_block_mm_isa,
    set_block_mm_prefetch,
)
from specdec.core.kernels.layout import pack, unpack

ISAS = {"avx512vnni": ("avx512vnni", "avx512", "avx2", "portable"), "avx512": ("avx512", "avx2", "portable"),
        "avx2": ("avx2", "portable"), "portable": ("portable",)}
ROWS = (1, 2, 5, 9, 13, 16, 17, 25)
# GGML type → (group, superblock, code range, with mins)
TYPES = {"Q4_K": (32, 256, (0, 16), True), "Q4_0": (32, 32, (-8, 8), False), "Q4_1": (32, 32, (0, 16), True),
         "Q6_K": (16, 256, (-32, 32), False), "Q5_0": (32, 32, (-16, 16), False), "Q8_0": (32, 32, (-128, 128), False)}


def blocks(qtype: str, n: int, k: int, seed: int = 0) -> BlockWeights:
    """Random blocks of one GGML type: f16-valued d / dmin as in a GGUF file, the type's code range, 6-bit
    scales and mins (Q4_K), signed int8 scales (Q6_K), unit scales (and Q4_1's unit mins) elsewhere."""
    group, superblock, (lo, hi), mins = TYPES[qtype]
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(lo, hi, (n, k), generator=g, dtype=torch.int16)
    d = (torch.rand(n, k // superblock, generator=g) * 1e-2).half().float()
    dmin = (torch.rand(n, k // superblock, generator=g) * 1e-2).half().float() if mins else torch.zeros_like(d)
    if qtype == "Q6_K":
        sc = torch.randint(-128, 128, (n, k // group), generator=g, dtype=torch.int16)
    elif qtype == "Q4_K":
        sc = torch.randint(0, 64, (n, k // group), generator=g, dtype=torch.int16)
    else:
        sc = torch.ones(n, k // group, dtype=torch.int16)
    if qtype == "Q4_K":
        mn = torch.randint(0, 64, (n, k // group), generator=g, dtype=torch.int16)
    else:       # Q4_1 as the file gives it: the block's min in dmin, mn = 1
        mn = torch.ones_like(sc) if mins else torch.zeros_like(sc)
    return BlockWeights(qtype, codes, group, superblock, d, dmin, sc, mn)


@pytest.fixture(scope="module", autouse=True)
def kernel():
    load_block_mm()
    yield
    set_block_mm_isa("auto")


def isas() -> tuple[str, ...]:
    """The code paths this CPU runs, best first."""
    set_block_mm_isa("auto")
    return ISAS[block_mm_isa()]


def test_the_kernel_is_built():
    assert block_mm_isa() in ISAS, "the C++ extension did not build"


def test_a_killed_build_does_not_block_the_next_load():
    """A build killed midway leaves ``cpp_extension``'s lock file in the build directory, on which every later load
    waited forever; a fresh process now loads the kernel and removes it."""
    import fcntl
    import subprocess
    import sys

    from specdec.core.kernels import build_directory

    directory = build_directory()
    with open(directory / "build.flock", "a") as held:      # (no build of another process in progress meanwhile)
        fcntl.flock(held, fcntl.LOCK_EX)
        (directory / "lock").touch()                          # what a killed build leaves
    out = subprocess.run([sys.executable, "-c", "from specdec.core.kernels import block_mm_isa; print(block_mm_isa())"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() in ISAS, out.stderr[-2000:]
    assert not (directory / "lock").exists()


@pytest.mark.parametrize("qtype", TYPES)
def test_packing_round_trips_and_keeps_the_weights(qtype):
    w = blocks(qtype, 37, 512)
    layer = BlockLinear.from_blocks(w, torch.float32)
    assert torch.equal(unpack(layer.qs, 37, layer.layout), w.codes)
    assert torch.equal(layer.dequantized(), w.dequantize())         # the file's values, exactly


@pytest.mark.parametrize("qtype", TYPES)
def test_equals_the_quantized_activations_matmul(qtype):
    w = blocks(qtype, 70, 512)                  # 70 columns: a partial last tile
    layer = BlockLinear.from_blocks(w, torch.float32)
    x = torch.randn(9, 512)
    expected = quantize_activations(x, w.superblock).double() @ w.dequantize().double().t()
    for isa in isas():
        set_block_mm_isa(isa)
        y = layer(x)
        torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item())
    # and close to the f32-activation product: 8-bit activations cost well under 1 % here
    full = x.double() @ w.dequantize().double().t()
    assert (y.double() - full).abs().max() < 0.02 * full.abs().max()


def test_activations_are_quantized_per_superblock_to_nearest_even():
    x = torch.tensor([[2.5, -1.5, 0.25, 127.0] + [0.0] * 12 + [0.0] * 16])     # group 0: scale 127 / 127 = 1
    q = quantize_activations(x, 16)
    assert q[0, :4].tolist() == [2.0, -2.0, 0.0, 127.0]
    assert torch.equal(q[0, 16:], torch.zeros(16))                   # an all-zero group stays zero
    # a K-quant (Q6_K: groups of 16) scales the activations per superblock of 256, as llama.cpp's Q8_K:
    # an outlier sets the scale of its whole superblock, not only of its group
    layer = BlockLinear.from_blocks(blocks("Q6_K", 16, 512), torch.float32)
    x = torch.randn(2, 512)
    x[:, 300] = 40.0
    per_superblock = quantize_activations(x, 256).double() @ layer.dequantized().double().t()
    per_group = quantize_activations(x, 16).double() @ layer.dequantized().double().t()
    tolerance = 1e-6 * per_superblock.abs().max().item()
    torch.testing.assert_close(layer(x).double(), per_superblock, rtol=1e-5, atol=tolerance)
    assert (per_group - per_superblock).abs().max() > 100 * tolerance


@pytest.mark.parametrize("qtype", TYPES)
def test_a_rows_output_does_not_depend_on_the_number_of_rows(qtype):
    layer = BlockLinear.from_blocks(blocks(qtype, 45, 768, seed=1), torch.float32)
    x = torch.randn(max(ROWS), 768)
    for isa in isas():
        set_block_mm_isa(isa)
        full = layer(x)
        for m in ROWS:
            for start in (0, max(ROWS) - m):     # the rows at the front and at the back of a call
                assert torch.equal(layer(x[start:start + m]), full[start:start + m]), (isa, m, start)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q4_0"])
def test_rows_of_zeros_give_the_epilogue_alone(qtype):
    """A call computes only its rows that hold a nonzero value: rows of zeros (``block_layer``'s padding tokens
    reaching an LM head) come out as 0 + bias (+ residual) and the other rows keep their bits, on every path."""
    layer = BlockLinear.from_blocks(blocks(qtype, 45, 512, seed=2), torch.float32, torch.randn(45))
    x = torch.randn(7, 512)
    x[[0, 3, 4]] = 0.0
    x[5, :256] = -0.0
    residual = torch.randn(7, 45)
    for isa in isas():
        set_block_mm_isa(isa)
        n, group, superblock, kind, offset, mins = layer.kernel_layout()
        y = torch.ops.specdec.block_mm(x, layer.qs, layer.d, layer.dmin, layer.sc, layer.mn, n, group, superblock,
                                       kind, offset, bool(mins), None, 0.0, False, layer.bias, residual)
        for r in range(7):
            alone = layer.fused(x[r:r + 1], residual=residual[r:r + 1])
            assert torch.equal(y[r:r + 1], alone), (isa, r)
        assert torch.equal(y[[0, 3, 4]], residual[[0, 3, 4]] + (0.0 + layer.bias)), isa
        assert torch.equal(layer(torch.zeros(3, 512)), torch.zeros(3, 45) + layer.bias)


@pytest.mark.parametrize("qtype", TYPES)
def test_every_instruction_set_gives_the_same_bits(qtype):
    if len(isas()) < 2:
        pytest.skip(f"one code path on this CPU ({block_mm_isa()})")
    layer = BlockLinear.from_blocks(blocks(qtype, 33, 512, seed=2), torch.float32)
    x = torch.randn(6, 512)
    results = {}
    for isa in isas():
        set_block_mm_isa(isa)
        results[isa] = layer(x)
    for isa, y in results.items():
        assert torch.equal(y, results["portable"]), isa


@pytest.mark.parametrize("qtype", TYPES)
def test_the_software_prefetch_changes_no_bit(qtype):
    """Calls prefetch the weight stream ahead (by default 4 KB, in every call); at any distance, even
    far past the end of the weights, and from any number of rows, the results are the same bits."""
    layer = BlockLinear.from_blocks(blocks(qtype, 40, 512, seed=3), torch.float32)
    x = torch.randn(17, 512)
    default = block_mm_prefetch()
    assert default == (4096, 1)
    try:
        set_block_mm_prefetch(0)
        expected = layer(x)
        for nbytes, min_rows in ((64, 1), (4096, 1), (4096, 3), (1 << 24, 1)):
            set_block_mm_prefetch(nbytes, min_rows)
            assert block_mm_prefetch() == (nbytes, min_rows)
            for m in (1, 2, 5, 17):
                assert torch.equal(layer(x[:m]), expected[:m]), (nbytes, min_rows, m)
    finally:
        set_block_mm_prefetch(*default)
    with pytest.raises(RuntimeError, match="bytes must be >= 0"):
        set_block_mm_prefetch(-1)
    with pytest.raises(RuntimeError, match="min_rows must be >= 1"):
        set_block_mm_prefetch(4096, 0)


@pytest.mark.parametrize("sizes", [(32, 16, 48), (20, 13, 7)])
def test_concatenated_layers_equal_the_parts(sizes):
    """``cat_rows`` (fused q/k/v, gate/up): whole tiles are concatenated, partial ones repacked."""
    parts = [BlockLinear.from_blocks(blocks("Q4_K", n, 256, seed=n), torch.float32) for n in sizes]
    fused = BlockLinear.cat_rows(parts)
    x = torch.randn(3, 256)
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=1))


def test_dequantize_is_the_ggml_formula():
    w = blocks("Q4_K", 3, 256)
    full = dequantize(w.codes, w.d, w.dmin, w.sc, w.mn, 32, 256)
    n, j = 2, 37                                 # weight 37: group 1 of superblock 0
    a = torch.tensor(w.d[n, 0].item() * float(w.sc[n, 1]), dtype=torch.float32)
    b = torch.tensor(w.dmin[n, 0].item() * float(w.mn[n, 1]), dtype=torch.float32)
    assert full[n, j].item() == (a * int(w.codes[n, j]) - b).item()


def test_runs_inside_a_compiled_graph():
    layer = BlockLinear.from_blocks(blocks("Q4_K", 40, 256), torch.float32)
    x = torch.randn(3, 256)

    def f(x):
        return torch.relu(layer(x * 2)) + 1

    # a fresh artifact record: what this process compiles is what DecoderModel.save stores (test_compiled)
    from torch.compiler._cache import CacheArtifactManager

    with CacheArtifactManager.with_fresh_cache():
        compiled = torch.compile(f, fullgraph=True, dynamic=False)
        assert torch.equal(compiled(x), f(x))


def test_bad_shapes_fail_clearly():
    layer = BlockLinear.from_blocks(blocks("Q4_K", 8, 256), torch.float32)
    args = (layer.qs, layer.d, layer.dmin, layer.sc, layer.mn, 8, 32, 256, KINDS["Q4_K"][0], 0, True)
    with pytest.raises(RuntimeError, match="K must be a multiple"):
        torch.ops.specdec.block_mm(torch.randn(2, 250), *args)
    with pytest.raises(RuntimeError, match="qs must be contiguous uint8"):
        torch.ops.specdec.block_mm(torch.randn(2, 512), *args)
    with pytest.raises(RuntimeError, match="group 16 or 32"):
        torch.ops.specdec.block_mm(torch.randn(2, 256), *args[:6], 16, 256, 0, 0, True)


def test_pack_rejects_nothing_it_cannot_hold():
    """Q8_0's code -128 (a valid int8) survives packing."""
    w = blocks("Q8_0", 16, 64)
    w.codes[0, 0] = -128
    layer = BlockLinear.from_blocks(w, torch.float32)
    assert torch.equal(unpack(pack(w.codes, layer.layout), 16, layer.layout), w.codes)


def test_python_fallback_defines_the_same_op(tmp_path):
    """Where the extension cannot be built, ``block_mm`` is defined in Python with the same schema and
    results (run in a fresh interpreter: one process holds one definition of the op)."""
    import subprocess
    import sys

    script = tmp_path / "fallback.py"
    script.write_text(
        "import torch\n"
        "torch.manual_seed(0)\n"          # deterministic inputs (unseeded, a draw occasionally missed 1e-5 in f32)
        "from specdec.core import kernels\n"
        "kernels._define_reference()\n"
        "kernels._state['isa'] = 'reference'\n"
        "from tests.test_block_mm import blocks\n"
        "from specdec.core.block_linear import BlockLinear\n"
        "from specdec.core.kernels import quantize_activations\n"
        "w = blocks('Q6_K', 20, 512)\n"
        "layer = BlockLinear.from_blocks(w, torch.float32)\n"
        "x = torch.randn(3, 512)\n"
        "ref = quantize_activations(x, 256).double() @ w.dequantize().double().t()\n"
        "torch.testing.assert_close(layer(x).double(), ref, rtol=1e-5, atol=1e-5)\n"
        "print('ok')\n")
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=root,
                         env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_one_group_superblocks_need_unit_scales():
    """Q4_0 / Q4_1 / Q5_0 / Q8_0 carry their scale and min in d and dmin; the kernel does not read sc / mn there, so
    a layer whose sc (or, with mins, mn) is not 1 is refused rather than computed wrongly."""
    for qtype, field in (("Q4_0", "sc"), ("Q8_0", "sc"), ("Q4_1", "mn")):
        w = blocks(qtype, 20, 64)
        getattr(w, field)[3, 1] = 2
        with pytest.raises(ValueError, match="must all be 1"):
            BlockLinear.from_blocks(w, torch.float32)

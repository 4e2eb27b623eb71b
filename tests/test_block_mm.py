"""The ``block_mm`` CPU kernel (``specdec.core.kernels``): it equals the matmul with the dequantized weight,
a row's output is bitwise the same whatever the number of rows in the call, and every instruction-set path
gives the same bits."""
import pytest
import torch

from specdec.core.kernels import block_mm_isa, dequantize, load_block_mm, set_block_mm_isa

ISAS = {"avx512": ("avx512", "avx2", "portable"), "avx2": ("avx2", "portable"), "portable": ("portable",)}
ROWS = (1, 2, 5, 9, 13, 16, 25)


def weights(n: int, k: int, u4: bool, group: int, superblock: int, seed: int = 0):
    """Random blocks of one layout: f16-valued d / dmin as in a GGUF file, 6-bit scales and mins (u4),
    signed int8 scales (s8)."""
    g = torch.Generator().manual_seed(seed)
    if u4:
        qs = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
        sc = torch.randint(0, 64, (n, k // group), dtype=torch.int8, generator=g)
        mn = torch.randint(0, 64, (n, k // group), dtype=torch.int8, generator=g)
    else:
        qs = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
        sc = torch.randint(-128, 128, (n, k // group), dtype=torch.int8, generator=g)
        mn = torch.zeros(n, k // group, dtype=torch.int8)
    d = (torch.rand(n, k // superblock, generator=g) * 1e-2).half().float()
    dmin = (torch.rand(n, k // superblock, generator=g) * 1e-2).half().float()
    return qs, d, dmin, sc, mn, group, superblock


LAYOUTS = {"q4_k": (True, 32, 256), "q4_0": (True, 32, 32), "q6_k": (False, 16, 256), "q8_0": (False, 32, 32)}


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
    assert block_mm_isa() in ("avx512", "avx2", "portable"), "the C++ extension did not build"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_equals_the_dequantized_matmul(layout):
    u4, group, superblock = LAYOUTS[layout]
    w = weights(70, 512, u4, group, superblock)
    x = torch.randn(9, 512)
    expected = x.double() @ dequantize(*w).double().t()
    for isa in isas():
        set_block_mm_isa(isa)
        y = torch.ops.specdec.block_mm(x, *w)
        torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_dequantize_is_the_ggml_formula():
    qs, d, dmin, sc, mn, group, superblock = weights(3, 256, True, 32, 256)
    w = dequantize(qs, d, dmin, sc, mn, group, superblock)
    n, j, i = 2, 37, 37 % 32                 # weight 37: group 1, first half, low nibble of byte 5
    q = int(qs[n, 16 + i] & 15) if i < 16 else int(qs[n, 16 + i - 16] >> 4)
    a = torch.tensor(d[n, 0].item() * float(sc[n, 1]), dtype=torch.float32)
    b = torch.tensor(dmin[n, 0].item() * float(mn[n, 1]), dtype=torch.float32)
    assert w[n, j].item() == (a * q - b).item()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_rows_output_does_not_depend_on_the_number_of_rows(layout):
    u4, group, superblock = LAYOUTS[layout]
    w = weights(45, 768, u4, group, superblock, seed=1)
    x = torch.randn(max(ROWS), 768)
    for isa in isas():
        set_block_mm_isa(isa)
        full = torch.ops.specdec.block_mm(x, *w)
        for m in ROWS:
            for start in (0, max(ROWS) - m):     # the rows at the front and at the back of a call
                y = torch.ops.specdec.block_mm(x[start:start + m].contiguous(), *w)
                assert torch.equal(y, full[start:start + m]), (isa, m, start)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_instruction_set_gives_the_same_bits(layout):
    if len(isas()) < 2:
        pytest.skip(f"one code path on this CPU ({block_mm_isa()})")
    u4, group, superblock = LAYOUTS[layout]
    w = weights(33, 512, u4, group, superblock, seed=2)
    x = torch.randn(6, 512)
    results = {}
    for isa in isas():
        set_block_mm_isa(isa)
        results[isa] = torch.ops.specdec.block_mm(x, *w)
    for isa, y in results.items():
        assert torch.equal(y, results["portable"]), isa


def test_runs_inside_a_compiled_graph():
    w = weights(40, 256, True, 32, 256)
    x = torch.randn(3, 256)

    def f(x):
        return torch.relu(torch.ops.specdec.block_mm(x * 2, *w)) + 1

    # a fresh artifact record: what this process compiles is what DecoderModel.save stores (test_compiled)
    from torch.compiler._cache import CacheArtifactManager

    with CacheArtifactManager.with_fresh_cache():
        compiled = torch.compile(f, fullgraph=True, dynamic=False)
        assert torch.equal(compiled(x), f(x))


def test_bad_shapes_fail_clearly():
    qs, d, dmin, sc, mn, group, superblock = weights(8, 256, True, 32, 256)
    with pytest.raises(RuntimeError, match="K must be a multiple"):
        torch.ops.specdec.block_mm(torch.randn(2, 250), qs, d, dmin, sc, mn, group, superblock)
    with pytest.raises(RuntimeError, match="qs shape"):
        torch.ops.specdec.block_mm(torch.randn(2, 512), qs, d, dmin, sc, mn, group, superblock)


def test_python_fallback_defines_the_same_op(tmp_path):
    """Where the extension cannot be built, ``block_mm`` is defined in Python with the same schema and
    results (run in a fresh interpreter: one process holds one definition of the op)."""
    import subprocess
    import sys

    script = tmp_path / "fallback.py"
    script.write_text(
        "import torch\n"
        "from specdec.core import kernels\n"
        "kernels._define_reference()\n"
        "g = torch.Generator().manual_seed(0)\n"
        "qs = torch.randint(0, 256, (6, 128), dtype=torch.uint8, generator=g)\n"
        "d, dmin = torch.rand(6, 1, generator=g), torch.rand(6, 1, generator=g)\n"
        "sc = torch.randint(0, 64, (6, 8), dtype=torch.int8, generator=g)\n"
        "x = torch.randn(3, 256, generator=g)\n"
        "y = torch.ops.specdec.block_mm(x, qs, d, dmin, sc, sc, 32, 256)\n"
        "ref = x.double() @ kernels.dequantize(qs, d, dmin, sc, sc, 32, 256).double().t()\n"
        "torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4)\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]

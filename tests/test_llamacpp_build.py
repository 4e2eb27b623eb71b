"""The competitor's build options (specdec.tools.bench.llamacpp): native, except on CPUs with AMX, where
ggml's AMX kernels crash and the build names the CPU's other instruction sets instead."""
from __future__ import annotations

from specdec.tools.bench import llamacpp

SAPPHIRE_RAPIDS = ["avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vbmi", "avx512_vnni", "avx512_bf16",
                   "avx_vnni", "amx_tile", "amx_int8", "amx_bf16"]
ZEN4 = [flag for flag in SAPPHIRE_RAPIDS if not flag.startswith("amx")]


def test_a_cpu_without_amx_gets_the_native_build():
    assert llamacpp.cmake_options(ZEN4) == llamacpp.CMAKE_OPTIONS
    assert "-DGGML_NATIVE=ON" in llamacpp.cmake_options(ZEN4)


def test_a_cpu_with_amx_gets_its_instruction_sets_without_amx(monkeypatch):
    options = llamacpp.cmake_options(SAPPHIRE_RAPIDS)
    assert "-DGGML_NATIVE=OFF" in options and "-DGGML_NATIVE=ON" not in options
    for option in ("-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON", "-DGGML_AVX512_VBMI=ON",
                   "-DGGML_AVX2=ON", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"):
        assert option in options, option
    monkeypatch.setattr(llamacpp, "cpu_info", lambda: ("Intel Xeon", sorted(SAPPHIRE_RAPIDS)))
    with_amx = llamacpp.cpu_key()
    monkeypatch.setattr(llamacpp, "cpu_info", lambda: ("Intel Xeon", sorted(ZEN4)))
    assert llamacpp.cpu_key() != with_amx     # another CPU, another build directory

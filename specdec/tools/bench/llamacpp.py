"""llama.cpp's command-line programs as a competitor in benchmarks (never a dependency of specdec or its CI).

:func:`llamacpp_bin_dir` gives a build of llama.cpp for this CPU, made once from the llama.cpp sources
vendored in the newest ``llama-cpp-python`` sdist (downloaded with ``pip download``, not installed) and
cached in ``$SPECDEC_CACHE/llama.cpp/<llama-cpp-python version>-<CPU hash>/bin`` (``-DGGML_NATIVE=ON``:
the binaries use this CPU's instruction set, hence one build per CPU model and flags). Only the two
programs used here are built and kept, statically linked: ``llama-completion`` (``llama-cli`` in versions
that have no ``llama-completion``) and ``llama-speculative``. ``$SPECDEC_LLAMACPP_DIR`` names an existing
directory holding them instead.

:func:`run_completion` (target-only greedy decoding) and :func:`run_speculative` (greedy speculative
decoding with a draft model) run one prompt and return a :class:`LlamaCppRun` parsed from llama.cpp's
own timing lines. The prompt is a raw string (chat template already applied), passed in a file.

The build uses OpenMP, whose threads spin at each barrier: when another process keeps one of the cores
busy, ``threads`` equal to the core count slows llama.cpp down by an order of magnitude or more (SmolLM2-135M
on 2 busy cores: 1.4 tok/s with 2 threads, 46 with 1). Time it on an idle machine, or with fewer threads, or
pass ``env={"OMP_WAIT_POLICY": "PASSIVE"}`` (38 tok/s in the same conditions).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO

from specdec.core.cache_files import cache_dir

PACKAGE = "llama-cpp-python"
ENV_DIR = "SPECDEC_LLAMACPP_DIR"          # an existing bin directory: no download, no build
ENV_JOBS = "SPECDEC_LLAMACPP_JOBS"        # parallel compile jobs (default: all CPUs)
SPECULATIVE = "llama-speculative"
COMPLETION_NAMES = ("llama-completion", "llama-cli")   # the plain completion program, newest name first
CMAKE_OPTIONS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
                 "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                 "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_TOOLS=ON",
                 "-DLLAMA_BUILD_EXAMPLES=ON")
BUILD_INFO = "build.json"
FAILED_LOG = "build-failed.log"          # the log of the last failed build, in the cache
TAIL_LINES = 30                           # lines of a failed program's output quoted in the error

_NUM = r"([0-9]+(?:\.[0-9]+)?)"
# the perf lines' prefix is the printing function: llama_perf_context_print, or common_perf_print in newer versions
_PERF = r"(?:llama_perf_context_print|common_perf_print|perf_print):"
_PROMPT_EVAL = re.compile(rf"{_PERF}\s*prompt eval time\s*=\s*{_NUM} ms\s*/\s*(\d+) tokens")
_EVAL = re.compile(rf"{_PERF}\s*eval time\s*=\s*{_NUM} ms\s*/\s*(\d+) runs")
_TOTAL = re.compile(rf"{_PERF}\s*total time\s*=\s*{_NUM} ms\s*/\s*(\d+) tokens")
_ENCODED = re.compile(rf"encoded\s+(\d+) tokens in\s+{_NUM} seconds")
_DECODED = re.compile(rf"decoded\s+(\d+) tokens in\s+{_NUM} seconds, speed:\s*{_NUM} t/s")
_SPEC_COUNT = re.compile(r"\b(n_draft|n_drafted|n_accept)\s*=\s*(\d+)\s*$", re.MULTILINE)  # last ones win


# ---------------------------------------------------------------------------------------------- results
@dataclass
class LlamaCppRun:
    """One llama.cpp run, from its own timing lines.

    ``prompt_ms`` is the prompt's prefill (both models' for speculative runs), ``gen_ms`` the decoding
    after it; ``gen_tokens`` counts every generated token, the first one (sampled from the prefill's
    logits) included, so ``e2e_tok_s`` = ``gen_tokens / (prompt_ms + gen_ms)`` is the end-to-end figure.
    ``decode_tok_s`` is llama.cpp's own decode speed: its decode steps (``decode_runs``, one per token
    after the first) per second for ``llama-completion``, generated tokens per decoding second for
    ``llama-speculative``.
    """

    program: str
    command: list[str]
    prompt_tokens: int
    prompt_ms: float
    gen_tokens: int
    gen_ms: float
    total_ms: float
    text: str
    decode_runs: int | None = None
    n_draft: int | None = None
    n_drafted: int | None = None
    n_accept: int | None = None
    wall_s: float = 0.0
    output: str = field(default="", repr=False)

    @property
    def prompt_tok_s(self) -> float:
        """Prompt tokens per second of prefill."""
        return self.prompt_tokens / (self.prompt_ms / 1e3) if self.prompt_ms > 0 else float("nan")

    @property
    def decode_tok_s(self) -> float:
        """Decode speed, as llama.cpp reports it (see the class docstring)."""
        steps = self.decode_runs if self.decode_runs is not None else self.gen_tokens
        return steps / (self.gen_ms / 1e3) if self.gen_ms > 0 else float("nan")

    @property
    def e2e_tok_s(self) -> float:
        """Generated tokens per second of prefill plus decoding."""
        ms = self.prompt_ms + self.gen_ms
        return self.gen_tokens / (ms / 1e3) if ms > 0 else float("nan")

    @property
    def acceptance(self) -> float | None:
        """Accepted / drafted tokens (speculative runs only)."""
        if self.n_drafted is None or self.n_accept is None:
            return None
        return self.n_accept / self.n_drafted if self.n_drafted else 0.0

    def as_dict(self, output: bool = False) -> dict:
        """A JSON-friendly dict: the fields (``output`` only when asked) and the derived rates."""
        d = asdict(self)
        if not output:
            d.pop("output")
        d.update(prompt_tok_s=self.prompt_tok_s, decode_tok_s=self.decode_tok_s, e2e_tok_s=self.e2e_tok_s,
                 acceptance=self.acceptance)
        return d


# ---------------------------------------------------------------------------------------------- build
def cpu_info() -> tuple[str, list[str]]:
    """The CPU's model name and sorted feature flags, from /proc/cpuinfo (empty where unreadable)."""
    model, flags = "", []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "Model", "CPU part") and not model:
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = sorted(value.split())
    except OSError:
        pass
    return model, flags


# On a CPU with AMX a native build runs ggml's AMX kernels, which crash with a segmentation fault in the first
# decode step on the 2-core Xeons here (ggml_backend_amx_mul_mat): there the build names this CPU's other
# instruction sets instead (/proc/cpuinfo flag → ggml option) and turns AMX off.
NO_AMX_OPTIONS = {"avx": "-DGGML_AVX=ON", "avx2": "-DGGML_AVX2=ON", "fma": "-DGGML_FMA=ON", "f16c": "-DGGML_F16C=ON",
                  "avx_vnni": "-DGGML_AVX_VNNI=ON", "avx512f": "-DGGML_AVX512=ON",
                  "avx512vbmi": "-DGGML_AVX512_VBMI=ON", "avx512_vnni": "-DGGML_AVX512_VNNI=ON",
                  "avx512_bf16": "-DGGML_AVX512_BF16=ON"}


def cmake_options(flags: list[str]) -> tuple[str, ...]:
    """The configure options of the build on a CPU with feature ``flags`` (``cpu_info``): native, or without
    AMX where the CPU has it."""
    if "amx_int8" not in flags:
        return CMAKE_OPTIONS
    native = [o if o != "-DGGML_NATIVE=ON" else "-DGGML_NATIVE=OFF" for o in CMAKE_OPTIONS]
    return (*native, *(o for flag, o in NO_AMX_OPTIONS.items() if flag in flags),
            "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF")


def cpu_key() -> str:
    """A short hash of the CPU's model name and feature flags (what ``-DGGML_NATIVE=ON`` compiles for) and of
    the build's options."""
    model, flags = cpu_info()
    if not model and not flags:
        model = f"{platform.machine()} {platform.processor()}"
    text = f"{platform.machine()}\n{model}\n{' '.join(flags)}\n{' '.join(cmake_options(flags))}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _version_key(version: str) -> tuple:
    return tuple(int(p) if p.isdigit() else -1 for p in re.split(r"[.+-]", version))


def _completion_program(bin_dir: Path) -> Path:
    for name in COMPLETION_NAMES:
        if (bin_dir / name).is_file():
            return bin_dir / name
    raise RuntimeError(f"{bin_dir} has none of {', '.join(COMPLETION_NAMES)}")


def _is_bin_dir(path: Path) -> bool:
    return (path / SPECULATIVE).is_file() and any((path / n).is_file() for n in COMPLETION_NAMES)


def _log(progress: bool, message: str) -> None:
    if progress:
        print(f"[llama.cpp] {message}", file=sys.stderr, flush=True)


def _tail(text: str, n: int = TAIL_LINES) -> str:
    return "\n".join(text.splitlines()[-n:])


def _run_logged(cmd: list[str], log: Path, what: str, progress: bool, cwd: Path | None = None) -> None:
    """Run ``cmd`` with its output appended to ``log``; with ``progress``, echo cmake's ``[ NN%]`` every 10%."""
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    errors="replace", cwd=cwd)
        except OSError as e:
            raise RuntimeError(f"{what} failed: cannot run {cmd[0]!r} ({e})") from e
        shown = -10
        assert proc.stdout is not None
        for line in proc.stdout:
            f.write(line)
            m = re.match(r"\[\s*(\d+)%\]", line)
            if progress and m and int(m.group(1)) >= shown + 10:
                shown = int(m.group(1))
                _log(True, f"  {what}: {shown}%")
        rc = proc.wait()
    if rc != 0:
        raise RuntimeError(f"{what} failed (exit code {rc}): `{' '.join(cmd)}`; the last lines of its log:\n"
                           + _tail(log.read_text(errors="replace")))


def _find_cached(root: Path, key: str) -> Path | None:
    builds = [p for p in root.glob(f"*-{key}") if not p.name.startswith(".") and _is_bin_dir(p / "bin")]
    if not builds:
        return None
    return max(builds, key=lambda p: _version_key(p.name[: -len(key) - 1])) / "bin"


def _build(root: Path, key: str, progress: bool, jobs: int | None) -> Path:
    if shutil.which("cmake") is None:
        raise RuntimeError("cmake is not installed (needed once to build llama.cpp): "
                           "`apt-get install cmake` or `pip install cmake`")
    jobs = jobs or int(os.environ.get(ENV_JOBS, "0")) or os.cpu_count() or 1
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    log = work / "build.log"
    try:
        _log(progress, f"downloading the newest {PACKAGE} sdist with pip into {work} ...")
        sdist_dir = work / "sdist"
        _run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                     "--disable-pip-version-check", PACKAGE, "-d", str(sdist_dir)], log,
                    f"pip download {PACKAGE} (network?)", False)
        sdists = sorted(sdist_dir.glob("*.tar.gz"))
        if not sdists:
            raise RuntimeError(f"pip download produced no sdist of {PACKAGE} in {sdist_dir}")
        m = re.match(r"llama_cpp_python-(.+)\.tar\.gz$", sdists[-1].name, re.IGNORECASE)
        version = m.group(1) if m else sdists[-1].name.removesuffix(".tar.gz")
        final = root / f"{version}-{key}"
        if _is_bin_dir(final / "bin"):
            _log(progress, f"{final} already built (by another process)")
            return final / "bin"
        _log(progress, f"extracting {sdists[-1].name} ...")
        with tarfile.open(sdists[-1]) as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(work / "src", filter="data")
            else:
                tar.extractall(work / "src")
        srcs = list((work / "src").glob("*/vendor/llama.cpp/CMakeLists.txt"))
        if not srcs:
            raise RuntimeError(f"{sdists[-1].name} has no vendor/llama.cpp directory")
        src = srcs[0].parent
        completion = next((n for n in COMPLETION_NAMES
                           if any(f"set(TARGET {n})" in p.read_text(errors="replace")
                                  for p in list(src.glob("tools/*/CMakeLists.txt"))
                                  + list(src.glob("examples/*/CMakeLists.txt")))), None)
        if completion is None:
            raise RuntimeError(f"llama.cpp in {sdists[-1].name} defines none of {', '.join(COMPLETION_NAMES)}")
        build = work / "build"
        t0 = time.perf_counter()
        _log(progress, f"configuring llama.cpp ({PACKAGE} {version}) with cmake ...")
        configure = ["cmake", "-S", str(src), "-B", str(build), *cmake_options(cpu_info()[1])]
        _run_logged(configure, log, "cmake configure", progress)
        targets = [completion, SPECULATIVE]
        _log(progress, f"compiling {', '.join(targets)} with {jobs} job(s) (several minutes on few cores) ...")
        compile_cmd = ["cmake", "--build", str(build), "--config", "Release", "-j", str(jobs), "--target", *targets]
        _run_logged(compile_cmd, log, "cmake build", progress)
        build_s = time.perf_counter() - t0
        stage = work / "out"
        (stage / "bin").mkdir(parents=True)
        built = build / "bin"
        for name in targets:
            exe = next((p for p in (built / name, built / "Release" / name) if p.is_file()), None)
            if exe is None:
                raise RuntimeError(f"the build produced no {name} in {built}")
            shutil.copy2(exe, stage / "bin" / name)
        for lib in list(built.glob("*.so*")) + list(built.glob("*.dylib")):     # only for a shared build
            shutil.copy2(lib, stage / "bin" / lib.name)
        check = subprocess.run([str(stage / "bin" / completion), "--version"], check=False, capture_output=True,
                               text=True, errors="replace", timeout=60)
        if check.returncode != 0:
            raise RuntimeError(f"the built {completion} does not run (exit code {check.returncode}):\n"
                               + _tail(check.stdout + check.stderr))
        info = {"package": PACKAGE, "version": version, "cpu_key": key, "cpu": _cpu_model(),
                "configure": configure, "build": compile_cmd, "build_s": round(build_s, 1),
                "completion": completion, "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        (stage / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")
        try:
            os.rename(stage, final)
        except OSError:
            if not _is_bin_dir(final / "bin"):     # not another process's finished build: a real error
                raise
        _log(progress, f"built in {build_s:.0f} s: {final / 'bin'}")
        return final / "bin"
    except RuntimeError as e:
        if not log.is_file():
            raise
        kept = root / FAILED_LOG                    # the work directory goes: keep its log
        shutil.copyfile(log, kept)
        raise RuntimeError(f"{e}\n(the whole log: {kept})") from e
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def llamacpp_bin_dir(build: bool = True, progress: bool = True, jobs: int | None = None) -> Path:
    """The directory of llama.cpp's programs for this CPU, built once if missing.

    ``$SPECDEC_LLAMACPP_DIR``, when set, is used as it is (it must hold ``llama-speculative`` and
    ``llama-completion`` or ``llama-cli``). Otherwise the newest cached build for this CPU
    (``$SPECDEC_CACHE/llama.cpp/<version>-<cpu_key()>/bin``) is returned; without one, and with ``build``,
    the newest ``llama-cpp-python`` sdist is downloaded with pip and its ``vendor/llama.cpp`` built with cmake
    (``jobs`` parallel compile jobs, default ``$SPECDEC_LLAMACPP_JOBS`` or every CPU) in a temporary directory
    renamed into place when complete. Progress messages go to stderr. Raises ``RuntimeError`` when there is
    no build and ``build`` is false, or when pip, the network or cmake fail.
    """
    env = os.environ.get(ENV_DIR)
    if env:
        path = Path(env).expanduser()
        if not _is_bin_dir(path):
            raise RuntimeError(f"${ENV_DIR}={env} does not hold {SPECULATIVE} and one of "
                               f"{', '.join(COMPLETION_NAMES)}")
        return path
    root, key = cache_dir() / "llama.cpp", cpu_key()
    cached = _find_cached(root, key)
    if cached is not None:
        return cached
    if not build:
        raise RuntimeError(f"no llama.cpp build for this CPU in {root} (key {key}); "
                           f"call llamacpp_bin_dir(build=True) or set ${ENV_DIR}")
    return _build(root, key, progress, jobs)


# ---------------------------------------------------------------------------------------------- runs
@functools.cache
def _help_text(program: str) -> str:
    out = subprocess.run([program, "--help"], check=False, capture_output=True, text=True, errors="replace",
                         timeout=60, stdin=subprocess.DEVNULL)
    return out.stdout + out.stderr


def _has_flag(program: Path, flag: str) -> bool:
    return re.search(rf"(^|[\s,]){re.escape(flag)}([\s,=]|$)", _help_text(str(program)), re.MULTILINE) is not None


def _draft_flag(program: Path) -> str:
    """The draft-length flag of this version: ``--spec-draft-n-max``, ``--draft-max`` or ``--draft``."""
    for flag in ("--spec-draft-n-max", "--draft-max", "--draft"):
        if _has_flag(program, flag):
            return flag
    raise RuntimeError(f"{program} --help names no draft-length flag (--spec-draft-n-max / --draft-max / --draft)")


def _strip_prompt(stdout: str, prompt: str) -> str:
    """``stdout`` without llama.cpp's echo of the prompt (leading newlines and a BOS piece tolerated)."""
    text = stdout.lstrip("\n")
    if prompt and prompt in text[: len(prompt) + 64]:
        return text[text.index(prompt) + len(prompt):]
    return text


def _execute(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[str, str, float]:
    t0 = time.perf_counter()
    try:
        out = subprocess.run(cmd, check=False, capture_output=True, text=True, errors="replace",
                             timeout=timeout, stdin=subprocess.DEVNULL,
                             env={**os.environ, **env} if env else None)
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        text += (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise RuntimeError(f"`{' '.join(cmd)}` timed out after {timeout:.0f} s; its last output:\n{_tail(text)}") from e
    except OSError as e:
        raise RuntimeError(f"cannot run {cmd[0]} ({e})") from e
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed (exit code {out.returncode}); its last output:\n"
                           + _tail(out.stdout + out.stderr))
    return out.stdout, out.stderr, wall


def _missing(cmd: list[str], what: str, stdout: str, stderr: str) -> RuntimeError:
    return RuntimeError(f"`{' '.join(cmd)}` printed no {what} line; its last output:\n{_tail(stdout + stderr)}")


def _prompt_file(prompt: str) -> IO[str]:
    """A temporary file for ``-f`` (deleted when closed; a context manager) that makes llama.cpp read ``prompt``
    exactly: ``-f`` drops one trailing newline from the file, so one is added (a chat prompt ends with one)."""
    f = tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8", newline="")  # noqa: SIM115
    f.write(prompt + "\n")
    f.flush()
    return f


def run_completion(bin_dir: str | Path, gguf: str | Path, prompt: str, n_predict: int, threads: int,
                   ctx: int = 2048, ignore_eos: bool = False, timeout: float = 1800.0,
                   extra_args: list[str] | None = None, env: dict[str, str] | None = None) -> LlamaCppRun:
    """Target-only greedy decoding of ``prompt`` (raw text, chat template included) with ``llama-completion``.

    Runs ``llama-completion -m GGUF -f PROMPT_FILE -n N_PREDICT -c CTX -t THREADS -tb THREADS --temp 0
    --top-k 1 -no-cnv --no-display-prompt [--ignore-eos]`` (``-no-cnv``: one non-interactive completion) and
    parses its perf lines (``llama_perf_context_print:`` / ``common_perf_print:``). ``extra_args`` are appended,
    ``env`` is added to the environment (see the module docstring on ``OMP_WAIT_POLICY``). Raises
    ``RuntimeError`` (with the last lines of output) when the program fails, times out or prints no timing lines.
    """
    program = _completion_program(Path(bin_dir))
    with _prompt_file(prompt) as pf:
        cmd = [str(program), "-m", str(gguf), "-f", pf.name, "-n", str(n_predict), "-c", str(ctx),
               "-t", str(threads), "-tb", str(threads), "--temp", "0", "--top-k", "1", "-no-cnv"]
        if _has_flag(program, "--no-display-prompt"):
            cmd.append("--no-display-prompt")
        cmd = [*cmd, *(["--ignore-eos"] if ignore_eos else []), *(extra_args or [])]
        stdout, stderr, wall = _execute(cmd, timeout, env)
    log = stdout + "\n" + stderr
    pe, ev, tot = _PROMPT_EVAL.findall(log), _EVAL.findall(log), _TOTAL.findall(log)
    if not (pe and ev and tot):
        raise _missing(cmd, "perf `prompt eval time` / `eval time` / `total time`", stdout, stderr)
    runs = int(ev[-1][1])       # decode steps: every generated token but the first (sampled after the prefill)
    return LlamaCppRun(program=program.name, command=cmd, prompt_tokens=int(pe[-1][1]), prompt_ms=float(pe[-1][0]),
                       gen_tokens=runs + 1, gen_ms=float(ev[-1][0]),
                       total_ms=float(tot[-1][0]), text=_strip_prompt(stdout, prompt).strip("\n"),
                       decode_runs=runs, wall_s=wall, output=log)


def run_speculative(bin_dir: str | Path, target_gguf: str | Path, draft_gguf: str | Path, prompt: str,
                    n_predict: int, threads: int, n_draft: int, ctx: int = 2048, ignore_eos: bool = False,
                    timeout: float = 1800.0, extra_args: list[str] | None = None,
                    env: dict[str, str] | None = None) -> LlamaCppRun:
    """Greedy speculative decoding of ``prompt`` with ``llama-speculative`` (target + draft model).

    Runs ``llama-speculative -m TARGET -md DRAFT -f PROMPT_FILE -n N_PREDICT -c CTX -t THREADS -tb THREADS
    [-td THREADS -tbd THREADS] --temp 0 --top-k 1 <draft flag> N_DRAFT [--ignore-eos]``, the draft flag being
    the one this version's ``--help`` names (``--spec-draft-n-max``, ``--draft-max`` or ``--draft``), and
    parses its ``encoded``/``decoded N tokens in X seconds`` lines, ``n_drafted`` / ``n_accept`` and the
    target's ``total time``. llama-speculative may overshoot ``n_predict`` by up to ``n_draft`` tokens
    (it stops after the step that crosses it); ``gen_tokens`` is what it decoded. ``extra_args`` and ``env``
    as in :func:`run_completion`.
    """
    program = Path(bin_dir) / SPECULATIVE
    if not program.is_file():
        raise RuntimeError(f"{program} is missing")
    with _prompt_file(prompt) as pf:
        cmd = [str(program), "-m", str(target_gguf), "-md", str(draft_gguf), "-f", pf.name, "-n", str(n_predict),
               "-c", str(ctx), "-t", str(threads), "-tb", str(threads)]
        if _has_flag(program, "-td"):
            cmd += ["-td", str(threads)]
        if _has_flag(program, "-tbd"):
            cmd += ["-tbd", str(threads)]
        cmd += ["--temp", "0", "--top-k", "1", _draft_flag(program), str(n_draft)]
        cmd = [*cmd, *(["--ignore-eos"] if ignore_eos else []), *(extra_args or [])]
        stdout, stderr, wall = _execute(cmd, timeout, env)
    log = stdout + "\n" + stderr
    enc, dec, tot = _ENCODED.search(log), _DECODED.search(log), _TOTAL.findall(log)
    if not (enc and dec):
        raise _missing(cmd, "`encoded/decoded N tokens in X seconds`", stdout, stderr)
    counts = {k: int(v) for k, v in _SPEC_COUNT.findall(log)}
    if "n_drafted" not in counts or "n_accept" not in counts:
        raise _missing(cmd, "n_drafted / n_accept", stdout, stderr)
    gen_ms = float(dec.group(2)) * 1e3
    return LlamaCppRun(program=program.name, command=cmd, prompt_tokens=int(enc.group(1)),
                       prompt_ms=float(enc.group(2)) * 1e3, gen_tokens=int(dec.group(1)), gen_ms=gen_ms,
                       total_ms=float(tot[-1][0]) if tot else float(enc.group(2)) * 1e3 + gen_ms,
                       text=_strip_prompt(stdout, prompt).strip("\n"), n_draft=counts.get("n_draft", n_draft),
                       n_drafted=counts["n_drafted"], n_accept=counts["n_accept"], wall_s=wall, output=log)

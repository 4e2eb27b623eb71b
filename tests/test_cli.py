"""The ``specdec`` command line on tiny checkpoints: every ``--draft`` choice gives the target's greedy
output, ``--stats``, the ``n_positions`` warning, one-line errors with exit code 2, threads, and the
help of every command."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdec import cli, options
from specdec.cli import generate, main
from specdec.eagle.checkpoint import copy_lm_head
from specdec.medusa import save_heads

from conftest import hf_greedy, prompt_ids
from test_eagle import random_eagle, tiny_target, write_eagle
from test_medusa import oracle_heads, token_map_target

REPO = Path(__file__).resolve().parents[1]
PROMPT = prompt_ids(9, seed=3)
# repeats, so that prompt lookup finds n-grams to copy
REPEATS = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]
SMALL = prompt_ids(9, seed=4, vocab=64)   # for the vocabulary-64 EAGLE and Medusa targets


def run(argv, capsys) -> tuple[int, str, str]:
    """``main(argv)`` in process → (exit code, stdout, stderr); argparse's exits become codes."""
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def generate_args(model, prompt=PROMPT, n=20, n_positions=64, *extra):
    return ["generate", "--prompt-ids", ",".join(map(str, prompt)), "--model", model, "--backend", "eager",
            "--amp", "f32", "--n-positions", n_positions, "--max-new-tokens", n, "--ignore-eos", "--threads", 1,
            *extra]


def new_ids(out: str) -> list[int]:
    return [int(t) for t in out.strip().splitlines()[-1].split(",")]


@pytest.fixture(autouse=True)
def restore_threads():
    """``main`` sets torch's thread count for the process; later tests (compiled kernels are specialised
    on it) must find the suite's own setting."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def eagle_models(tmp_path_factory):
    """A tiny target and an EAGLE head for it (NxD layout: the target's LM head copied in)."""
    root = tmp_path_factory.mktemp("cli-eagle")
    hf = tiny_target(0)
    hf.save_pretrained(root / "target")
    eagle1 = write_eagle(root / "eagle1", hf, random_eagle(hf, 1))
    return root / "target", copy_lm_head(eagle1, root / "target", root / "eagle")


@pytest.fixture(scope="module")
def medusa_models(tmp_path_factory):
    """A tiny target whose next token depends on the current one only, and Medusa heads that know it."""
    root = tmp_path_factory.mktemp("cli-medusa")
    hf = token_map_target(0, 64, 64)
    hf.save_pretrained(root / "target")
    save_heads(oracle_heads(hf, 4, noise=0.0, seed=0), root / "heads")
    return root / "target", root / "heads"


# ------------------------------------------------------------------ greedy: every --draft = target only
def test_target_only_matches_transformers(checkpoint, capsys):
    ck = checkpoint("llama")
    rc, out, err = run(generate_args(ck.path), capsys)
    assert rc == 0, err
    assert new_ids(out) == hf_greedy(ck.hf, PROMPT, 20)
    assert "20 tokens in" in err and "target only" in err and "1 thread," in err


@pytest.mark.parametrize("prompt", [PROMPT, REPEATS])
@pytest.mark.parametrize("draft", ["model", "lookup"])
def test_draft_choices_give_the_targets_greedy_output(checkpoint, capsys, draft, prompt):
    target = checkpoint("llama").path
    rc, out, err = run(generate_args(target, prompt), capsys)
    assert rc == 0, err
    reference = new_ids(out)
    extra = ["--draft", draft, "--stats"]
    if draft == "model":
        extra += ["--draft-path", checkpoint("llama-draft").path, "--k", 3]
    rc, out, err = run(generate_args(target, prompt, 20, 64, *extra), capsys)
    assert rc == 0, err
    assert new_ids(out) == reference
    assert f"--draft {draft} k={3 if draft == 'model' else 4}" in err   # lookup: default k 4
    assert "tau (mean acceptance length)" in err and "acceptance rate" in err
    assert "per-position acceptance" in err and "tokens/s" in err


@pytest.mark.parametrize("extra", [["--draft", "model", "--draft-vocab", "96"], ["--draft", "model", "--adaptive-k"],
                                   ["--draft", "lookup+model"], ["--draft", "lookup+model", "--draft-p-min", "0.1"],
                                   ["--draft", "lookup+model", "--adaptive-k"], ["--draft", "model", "--gate"],
                                   ["--draft", "model", "--gate", "--draft-window", "4"]])
def test_adaptive_k_and_lookup_plus_model_give_the_targets_greedy_output(checkpoint, capsys, extra):
    target = checkpoint("llama").path
    rc, out, err = run(generate_args(target, REPEATS), capsys)
    assert rc == 0, err
    reference = new_ids(out)
    rc, out, err = run(generate_args(target, REPEATS, 20, 64, *extra, "--draft-path", checkpoint("llama-draft").path,
                                     "--stats"), capsys)
    assert rc == 0, err
    assert new_ids(out) == reference
    assert f"--draft {extra[1]} k=4" in err and "acceptance rate" in err


def test_eagle_gives_the_targets_greedy_output(eagle_models, capsys):
    target, eagle = eagle_models
    rc, out, err = run(generate_args(target, SMALL), capsys)
    assert rc == 0, err
    reference = new_ids(out)
    rc, out, err = run(generate_args(target, SMALL, 20, 64, "--draft", "eagle", "--draft-path", eagle, "--stats"),
                       capsys)
    assert rc == 0, err
    assert new_ids(out) == reference
    assert "--draft eagle k=5" in err and "tau" in err   # default k
    rc, out, err = run(generate_args(target, SMALL, 20, 64, "--draft", "eagle", "--draft-path", eagle,
                                     "--draft-quantization", "int8"), capsys)     # the head's own int8: same output
    assert rc == 0, err
    assert new_ids(out) == reference


def stats_value(err: str, name: str) -> str:
    return next(line for line in err.splitlines() if line.strip().startswith(name)).split()[-1]


def test_medusa_gives_the_targets_greedy_output_and_checks_k(medusa_models, capsys):
    target, heads = medusa_models
    rc, out, err = run(generate_args(target, SMALL), capsys)
    assert rc == 0, err
    reference = new_ids(out)
    for tree, depth in (("chain_4", 4), ("small_8", None)):
        extra = ["--draft", "medusa", "--draft-path", heads, "--tree", tree, "--stats"]
        rc, out, err = run(generate_args(target, SMALL, 20, 64, *extra, *(["--k", depth] if depth else [])), capsys)
        assert rc == 0, err
        assert new_ids(out) == reference
        assert float(err.split("tau (mean acceptance length)")[1].split()[0]) > 1.5   # oracle heads
    rc, out, err = run(generate_args(target, SMALL, 20, 64, "--draft", "medusa", "--draft-path", heads,
                                     "--tree", "chain_4", "--k", 2), capsys)
    assert rc == 2 and "specdec: error: k=2 but a Medusa step drafts the tree's depth 4" in err
    assert "Traceback" not in err and out == ""


def test_sampling_runs_with_speculation(checkpoint, capsys):
    """Same seed, same sampled output, with or without the draft (lossless rows share their noise
    stream only through the target; here: it runs and emits exactly the budget)."""
    target, draft = checkpoint("llama").path, checkpoint("llama-draft").path
    rc, out, err = run(generate_args(target, PROMPT, 16, 64, "--temperature", "0.8", "--top-p", "0.9",
                                     "--top-k", "20", "--draft", "model", "--draft-path", draft), capsys)
    assert rc == 0, err
    assert len(new_ids(out)) == 16


def test_stats_without_speculation(checkpoint, capsys):
    rc, _, err = run(generate_args(checkpoint("llama").path, PROMPT, 8, 64, "--stats"), capsys)
    assert rc == 0 and "stats: target only (no speculation): tau 1.00" in err


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("draft", ["none", "model", "lookup", "eagle", "medusa", "eagle-tree", "lookup+eagle-tree",
                                   "lookup+eagle3-tree", "suffix+model"])
def test_precompile_builds_every_graph_the_request_uses(checkpoint, eagle_models, medusa_models, draft, temperature):
    """``precompile`` (what ``--backend compiled`` runs before the timed request) leaves no graph to be
    built mid-request: the eager backend builds the same keys cheaply, so compare the key sets."""
    from specdec import DecoderModel, LookupBranch, SamplingConfig, SpeculativeGenerator
    paths = {"none": (checkpoint("llama").path, None), "lookup": (checkpoint("llama").path, None),
             "model": (checkpoint("llama").path, checkpoint("llama-draft").path),
             "eagle": eagle_models, "medusa": medusa_models, "eagle-tree": eagle_models,
             "lookup+eagle-tree": eagle_models, "lookup+eagle3-tree": eagle_models,
             "suffix+model": (checkpoint("llama").path, checkpoint("llama-draft").path)}
    target_path, draft_path = paths[draft]
    # 256 positions: KV buckets [128, 256]; the prompt + 117 tokens end near the first bucket's edge,
    # so the last verify steps reach into the second
    argv = generate_args(target_path, SMALL, 117, 256, "--draft", draft)
    if draft_path is not None:
        argv += ["--draft-path", draft_path]
    spec = generate.checked_options(cli.build_parser().parse_args([str(a) for a in argv])).speculation
    target = DecoderModel.from_pretrained(target_path, n_positions=256, amp="f32", backend="eager", progress=False,
                                          sampling=SamplingConfig(do_sample=temperature > 0, temperature=temperature))
    proposer = spec.make_proposer(target)
    gen = None if proposer is None else SpeculativeGenerator(proposer, target, spec.default_k)
    options.precompile(target, gen, len(SMALL), 117, progress=False)
    inner = proposer.draft if isinstance(proposer, LookupBranch) else proposer
    models = [m for m in (target, inner and inner.model) if isinstance(m, DecoderModel)]
    built = [set(m.graphs.built) for m in models]
    (gen or target).generate([SMALL], max_new_tokens=117, eos_token_id=[], seed=0)
    for m, before in zip(models, built):
        assert set(m.graphs.built) <= before, sorted(k.describe() for k in set(m.graphs.built) - before)


# ------------------------------------------------------------------ n_positions
def test_warns_when_output_stops_at_n_positions(checkpoint, capsys):
    rc, out, err = run(generate_args(checkpoint("llama").path, PROMPT, 20, 16), capsys)
    assert rc == 0, err
    assert len(new_ids(out)) == 16 - len(PROMPT)
    assert "specdec: warning: output stopped at --n-positions 16 (prompt 9 + 7 new tokens), before " \
           "--max-new-tokens 20" in err
    rc, out, err = run(generate_args(checkpoint("llama").path, PROMPT, 7, 16), capsys)   # fits exactly
    assert rc == 0 and "warning: output stopped" not in err


# ------------------------------------------------------------------ errors: exit code 2, one line
def test_context_buckets_option(checkpoint, capsys):
    """--context-buckets reaches the model (a prompt runs in the smallest bucket that holds it) and leaves the
    greedy output alone; a prompt longer than the largest bucket is refused with the buckets named."""
    target = checkpoint("llama").path
    rc, out, err = run(generate_args(target), capsys)
    assert rc == 0, err
    reference = new_ids(out)
    exact = generate_args(target, PROMPT, 20, 64, "--context-buckets", f"{len(PROMPT)},32")
    rc, out, err = run(exact, capsys)
    assert rc == 0, err
    assert new_ids(out) == reference
    model = options.options_from(options.ModelOptions, cli.build_parser().parse_args([str(a) for a in exact])).load(
        progress=False)
    assert model.context_buckets == [len(PROMPT), 32]
    with pytest.raises(ValueError, match=r"prompt 0 has 33 tokens; the largest context bucket is 32"):
        model.generate([list(range(1, 34))], max_new_tokens=2)


def test_bad_arguments_exit_2_with_one_line(checkpoint, tmp_path, capsys):
    target = checkpoint("llama").path
    cases = [
        (generate_args(target, PROMPT, 8, 64, "--top-p", "2"), "argument --top-p: must be in (0, 1], got 2"),
        (generate_args(target, PROMPT, 8, 64, "--top-p", "0"), "argument --top-p: must be in (0, 1], got 0"),
        (generate_args(target, PROMPT, 8, 64, "--draft", "lookup", "--k", "-1"), "argument --k: must be >= 1, got -1"),
        (generate_args(target, PROMPT, 8, 64, "--draft", "lookup", "--k", "x"), "argument --k: 'x' is not an integer"),
        (generate_args(target, PROMPT, 8, 64, "--temperature", "-1"), "argument --temperature: must be >= 0"),
        (generate_args(target, PROMPT, 8, 64, "--temperature", "nan"), "argument --temperature: must be >= 0"),
        (generate_args(target, PROMPT, 0, 64), "argument --max-new-tokens: must be >= 1, got 0"),
        (generate_args(target, PROMPT, 8, 64, "--threads", "0"), "argument --threads: must be >= 1, got 0"),
        (generate_args(target, PROMPT, 8, 64, "--draft", "bogus"), "argument --draft: invalid choice: 'bogus'"),
        (generate_args(tmp_path / "missing", PROMPT, 8, 64), f"{tmp_path / 'missing'} does not exist"),
        (generate_args(tmp_path / "missing.gguf", PROMPT, 8, 64), "missing.gguf does not exist"),
        (generate_args(target, PROMPT, 8, 64, "--draft", "model", "--draft-path", tmp_path / "nope"),
         "argument --draft-path: " + f"{tmp_path / 'nope'} is not a directory"),
        (["generate", "--prompt-ids", "1,a"], "argument --prompt-ids: '1,a' is not a comma-separated list"),
        (generate_args(target, PROMPT, 8, 64, "--context-buckets", "16,x"),
         "argument --context-buckets: expected comma-separated integers, got '16,x'"),
        (generate_args(target, PROMPT, 8, 64, "--context-buckets", "16,128"),
         "context_buckets=[16, 128]: buckets must be positive and at most n_positions=64"),
        (generate_args(target, PROMPT, 8, 64, "--context-buckets", "8"),
         "prompt 0 has 9 tokens; the largest context bucket is 8"),
        (["generate", "--model", target], "give a prompt text or --prompt-ids"),
        (generate_args(target, PROMPT, 8, 64, "--draft", "model"),
         f"--draft model without --draft-path uses the shipped weights, trained for the embedded model "
         f"(smollm2-135m-instruct); for --model {target} give --draft-path DIR"),
        (generate_args(target, PROMPT, 8, 64, "--k", "3"), "--k needs --draft"),
        (generate_args(target, PROMPT, 8, 64, "--adaptive-k"), "--adaptive-k needs an unfused chain --draft"),
        (generate_args(target, PROMPT, 8, 64, "--draft", "medusa", "--adaptive-k"),
         "--adaptive-k needs an unfused chain --draft"),
        (generate_args(target, PROMPT, 8, 64, "--draft", "model", "--fused", "--adaptive-k"),
         "--adaptive-k needs an unfused chain --draft"),
        (generate_args(target, PROMPT, 8, 64, "--gate"), "--gate needs a --draft and runs unfused"),
        (generate_args(target, PROMPT, 8, 64, "--draft", "model", "--fused", "--gate"),
         "--gate needs a --draft and runs unfused"),
        (generate_args(target, PROMPT, 8, 64, "--draft", "lookup", "--tree", "chain_4"),
         "--tree is for --draft medusa"),
        (generate_args(target, PROMPT, 8, 64, "--draft", "medusa", "--draft-quantization", "int8"),
         "--draft-quantization is for --draft model, eagle, eagle-tree, eagle3 or eagle3-tree"),
        (generate_args(target, PROMPT, 8, 64, "--draft", "model", "--draft-quantization", "int2"),
         "argument --draft-quantization: invalid choice: 'int2'"),
        (generate_args(target, PROMPT, 8, 64, "--draft", "eagle", "--draft-vocab", "64"),
         "--draft-vocab restricts a draft model's LM head: it is for --draft model, lookup+model or suffix+model"),
        (generate_args(target, PROMPT, 8, 64, "--draft", "model", "--draft-vocab", "64", "--draft-quantization",
                       "int8"), "--draft-quantization int8 re-quantizes it"),
        (generate_args(target, PROMPT, 8, 64, "--draft", "model", "--draft-vocab", "0"),
         "argument --draft-vocab: must be >= 1, got 0"),
        (generate_args(target, PROMPT, 8, 64, "--draft", "model", "--draft-p-min", "1"),
         "argument --draft-p-min: must be in [0, 1) (0: off), got 1"),
        (generate_args(target, PROMPT, 8, 64, "--draft", "lookup", "--draft-p-min", "0.5"),
         "--draft-p-min stops a draft model's chain early: it is for an unfused --draft model, lookup+model or "
         "suffix+model"),
        (generate_args(target, PROMPT, 8, 64, "--draft", "model", "--fused", "--draft-p-min", "0.5"),
         "--draft-p-min stops a draft model's chain early"),
        (generate_args(target, PROMPT, 8, 64, "--draft", "model", "--fused", "--draft-window", "8"),
         "--draft-window bounds what a draft model encodes at once: it is for an unfused --draft model"),
        (generate_args(target, PROMPT, 8, 64, "--draft", "model", "--draft-window", "0"),
         "argument --draft-window: must be >= 1, got 0"),
        (generate_args(target, PROMPT, 8, 64, "--draft", "lookup", "--draft-path", tmp_path),
         "--draft-path needs --draft model, eagle, eagle-tree, eagle3, eagle3-tree or medusa"),
        (generate_args(target, list(range(3, 70)), 8, 64), "the prompt has 67 tokens: --n-positions 64 leaves no room"),
        (generate_args(target, PROMPT, 8, 1000), "n_positions=1000 exceeds the model's max_position_embeddings=256"),
        (generate_args(target, [5, 999], 8, 64), "prompt 0 has token id 999 outside the vocabulary [0, 160)"),
        (["generate", "hello", "--model", target, "--backend", "eager", "--n-positions", "64"],
         "give the prompt as --prompt-ids"),
    ]
    for argv, message in cases:
        rc, out, err = run(argv, capsys)
        assert rc == 2, (argv, rc, err)
        errors = [line for line in err.splitlines() if "error" in line]   # (+ progress bars, load warnings)
        assert len(errors) == 1 and "error: " in errors[0] and message in errors[0], (argv, err)
        assert "Traceback" not in err and out == "", (argv, out)


def test_errors_from_the_command_line(checkpoint):
    """As a process: exit status 2, one stderr line, no traceback."""
    p = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "--prompt-ids", "1,2", "--top-p", "2"],
                       cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().splitlines() == ["specdec generate: error: argument --top-p: must be in (0, 1], got 2 "
                                             "(see: specdec generate --help)"]


def test_wait_policy_set_for_the_command(checkpoint):
    """Started as a command without OMP_WAIT_POLICY, ``generate`` re-executes itself with the passive
    policy (libgomp reads it only when torch loads); a policy the user set is kept."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    argv = [sys.executable, "-m", "specdec.cli", *map(str, generate_args(checkpoint("llama").path, PROMPT, 4))]
    for policy, expect in ((None, "OMP_WAIT_POLICY=PASSIVE"), ("ACTIVE", "OMP_WAIT_POLICY=ACTIVE")):
        p = subprocess.run(argv, cwd=REPO, env={**env, **({"OMP_WAIT_POLICY": policy} if policy else {})},
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        assert expect in p.stderr and len(new_ids(p.stdout)) == 4


# ------------------------------------------------------------------ threads
def test_default_threads(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert options.default_threads() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "2,1")   # nested levels: the first
    assert options.default_threads() == 2
    for unset in ("", "zero", "0"):
        monkeypatch.setenv("OMP_NUM_THREADS", unset)
        assert options.default_threads() == options.available_cores()
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert options.default_threads() == options.available_cores() == len(os.sched_getaffinity(0))


def test_oversubscription_warning(monkeypatch):
    cores = options.available_cores()
    monkeypatch.setattr(os, "getloadavg", lambda: (cores + 0.5, 0.0, 0.0))
    warning = generate.oversubscribed(2)
    assert warning.startswith("specdec: warning: load average") and "\n" not in warning
    assert "(try --threads 1)" in warning and "(try" not in generate.oversubscribed(1)
    monkeypatch.setattr(os, "getloadavg", lambda: (cores - 0.5, 0.0, 0.0))
    assert generate.oversubscribed(2) is None


def test_threads_option_sets_torch_threads(checkpoint, capsys):
    n = torch.get_num_threads()
    try:
        rc, _, err = run(generate_args(checkpoint("llama").path, PROMPT, 4)[:-2] + ["--threads", "2"], capsys)
        assert rc == 0 and "2 threads," in err
    finally:
        torch.set_num_threads(n)


# ------------------------------------------------------------------ help
def commands() -> dict:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return sub.choices


def test_top_level_help_lists_exactly_the_commands(capsys):
    rc, out, _ = run(["--help"], capsys)
    assert rc == 0
    names = set(commands())
    assert names == {"generate", "serve", "bench", "bench-spec", "bench-serve", "bench-quality", "bench-coverage",
                     "plan", "train-draft", "train-eagle", "train-medusa", "build-tree", "eagle-lm-head"}
    for name in names:
        assert f"    {name}" in out
    assert "bench-eagle" not in out and "``" not in out


@pytest.mark.parametrize("command", sorted(commands()))
def test_every_command_help_renders(command, capsys):
    rc, out, err = run([command, "--help"], capsys)
    assert rc == 0 and err == ""
    assert out.startswith(f"usage: specdec {command}")
    assert "``" not in out and "%(" not in out
    assert len(out.splitlines()) > 3


# ------------------------------------------------------------------ typed options
def flat_fields(cls) -> set[str]:
    """The field names of an options dataclass, those of its nested options dataclasses included."""
    import dataclasses
    import typing
    hints = typing.get_type_hints(cls)
    return {name for f in dataclasses.fields(cls)
            for name in (flat_fields(hints[f.name]) if dataclasses.is_dataclass(hints[f.name]) else {f.name})}


def test_each_command_parses_into_its_options_with_their_defaults(monkeypatch):
    """A command's flags are its options' fields (same names; ``serve`` has no --gqa-strategy), and parsing
    no flags gives the options' defaults: a library caller and the command line mean the same by an absent
    option."""
    from specdec.serving.server import ServeOptions
    from specdec.tools.bench import coverage, quality, runtime, serving, speculative

    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
    parser = cli.build_parser()
    for command, cls, absent in (("generate", generate.GenerateOptions, set()),
                                 ("serve", ServeOptions, {"gqa_strategy"}),
                                 ("bench", runtime.RuntimeBenchOptions, set()),
                                 ("bench-spec", speculative.SpecBenchOptions, set()),
                                 ("bench-serve", serving.ServeBenchOptions, set()),
                                 ("bench-quality", quality.QualityBenchOptions, set()),
                                 ("bench-coverage", coverage.CoverageBenchOptions, set())):
        args = parser.parse_args([command])
        assert {name for name in flat_fields(cls) if not hasattr(args, name)} == absent, command
        assert set(vars(args)) - flat_fields(cls) == {"command", "func"}, command
        assert options.options_from(cls, args) == cls(), command

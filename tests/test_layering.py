"""The package reads top-down: runtime (core) ← speculation ← strategies ← the public API ←
tools. Every import of a ``specdec`` module (module level or inside a function) must point to the
same or a lower layer, and a strategy never imports another strategy.

The ``specdec`` command (``specdec/cli/``) is a leaf: no module of the package outside it, and no script of
``bench/`` or ``scripts/``, imports ``specdec.cli`` or a module of it; they take typed options
(``specdec.options``, the tools' option dataclasses) instead. ``specdec.train.cli`` (and ``eagle_cli`` /
``medusa_cli``) is the training tool's own command line, not the ``specdec`` command: importing it is allowed."""
import ast
from pathlib import Path

import specdec

ROOT = Path(specdec.__file__).parent
SCRIPTS = [ROOT.parent / "bench", ROOT.parent / "scripts"]   # scripts that import specdec (not a package)

LAYERS = [  # lowest first: module-name prefixes (relative to the package)
    ("runtime", ["core"]),
    ("speculation", ["acceptance", "adaptive", "combined", "gate", "tree", "proposer", "verify", "speculative",
                     "fused"]),
    ("strategies", ["draft", "eagle", "medusa", "lookup", "suffix"]),
    ("api", ["generator", "registry", "shipped", "options", "arguments", "__init__"]),
    ("tools", ["train", "plan", "bench", "cli", "experiments", "serving"]),
]
STRATEGIES = {"draft", "eagle", "medusa", "lookup", "suffix"}


def layer_of(module: str) -> int:
    """Layer index of a module name relative to the package ('core.decoder', 'eagle', ...)."""
    head = module.split(".")[0]
    for i, (_, prefixes) in enumerate(LAYERS):
        if head in prefixes:
            return i
    raise AssertionError(f"specdec.{module} is in no layer: add it to LAYERS")


def resolve(parts: list[str], name: str) -> str:
    """``from <parts> import name``: the submodule ``parts.name`` if it exists, else ``parts``."""
    base = ROOT.joinpath(*parts)
    if (base / f"{name}.py").is_file() or (base / name).is_dir():
        parts = parts + [name]
    return ".".join(parts) or "__init__"


def imports_of(path: Path) -> list[str]:
    """Every specdec module ``path`` (a module of the package, or a script outside it) imports, relative to
    the package ('core.decoder', ...)."""
    package = list(path.relative_to(ROOT).parts[:-1]) if path.is_relative_to(ROOT) else []
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package[:len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
            elif node.module and node.module.split(".")[0] == "specdec":
                parts = node.module.split(".")[1:]
            else:
                continue
            out += [resolve(parts, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [a.name.split(".", 1)[1] for a in node.names if a.name.startswith("specdec.")]
    return out


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def violations() -> list[str]:
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        me = module_name(path)
        if me == "__init__":
            continue   # the package's face re-exports the API layer
        for imported in imports_of(path):
            if layer_of(imported) > layer_of(me):   # the package top ("__init__") is the API layer
                bad.append(f"{me} ({LAYERS[layer_of(me)][0]}) imports {imported} ({LAYERS[layer_of(imported)][0]})")
            elif me.split(".")[0] in STRATEGIES and imported.split(".")[0] in STRATEGIES - {me.split(".")[0]}:
                bad.append(f"strategy {me} imports strategy {imported}")
    return bad


def test_no_lower_layer_imports_a_higher_one():
    assert violations() == []


def test_the_check_catches_an_upward_import(tmp_path, monkeypatch):
    """The walker sees relative and absolute, module-level and function-level imports."""
    fake = tmp_path / "specdec"
    (fake / "core").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "core" / "__init__.py").write_text("")
    (fake / "core" / "bad.py").write_text("def f():\n    from ..speculative import Speculator\n")
    (fake / "eagle").mkdir()
    (fake / "eagle" / "x.py").write_text("import specdec.medusa.draft\nfrom specdec.train import cli\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", fake)
    found = violations()
    assert any("core.bad (runtime) imports speculative" in v for v in found), found
    assert any("eagle.x (strategies) imports train" in v for v in found), found
    assert any("strategy eagle.x imports strategy medusa.draft" in v for v in found), found


def cli_importers() -> list[str]:
    """The modules outside ``specdec/cli/`` and the scripts of ``bench/`` / ``scripts/`` that import the
    ``specdec`` command (``specdec.cli`` or a module of it), with what they import."""
    files = [p for p in ROOT.rglob("*.py") if p.relative_to(ROOT).parts[0] != "cli"]
    files += [p for folder in SCRIPTS if folder.is_dir() for p in folder.rglob("*.py")]
    return [f"{path} imports specdec.{imported}" for path in sorted(files) for imported in imports_of(path)
            if imported.split(".")[0] == "cli"]


def test_no_module_imports_the_command_line():
    assert SCRIPTS[0].is_dir() and cli_importers() == []


def test_the_check_catches_an_import_of_the_command_line(tmp_path, monkeypatch):
    """Relative and absolute imports of ``specdec.cli`` are found in the package and in scripts;
    ``specdec.train.cli`` and the command's own modules are not."""
    fake = tmp_path / "specdec"
    for folder in ("cli", "serving", "train"):
        (fake / folder).mkdir(parents=True)
    (fake / "cli" / "__init__.py").write_text("from .generate import run\nfrom ..serving import server\n")
    (fake / "cli" / "generate.py").write_text("")
    (fake / "serving" / "server.py").write_text("def f():\n    from ..cli import build_parser\n")
    (fake / "train" / "cli.py").write_text("")
    (fake / "train" / "eagle_cli.py").write_text("from .cli import run\nfrom specdec.train import cli\n")
    (fake / "options.py").write_text("from . import cli\n")
    scripts = tmp_path / "bench"
    scripts.mkdir()
    (scripts / "bench_x.py").write_text("import specdec.cli.generate\nfrom specdec.train.cli import run\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", fake)
    monkeypatch.setattr(__import__(__name__), "SCRIPTS", [scripts])
    found = cli_importers()
    assert found == [f"{scripts / 'bench_x.py'} imports specdec.cli.generate",
                     f"{fake / 'options.py'} imports specdec.cli",
                     f"{fake / 'serving' / 'server.py'} imports specdec.cli"], found

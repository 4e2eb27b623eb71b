"""The package reads top-down: runtime ← speculation ← strategies ← the public API ← tools. A module's layer
follows from where it is (``FOLDERS``, its top folder under ``specdec/``):

- ``specdec/core/``: the runtime;
- ``specdec/speculation/`` (the proposer protocol, verification, acceptance, trees, the speculation step) and
  ``specdec/fused/``: the speculation layer;
- one folder per strategy (``draft``, ``eagle``, ``medusa``, ``lookup``, ``suffix``);
- the modules at the package's top (``specdec/*.py``, ``__init__`` included): the public API;
- ``specdec/tools/`` (training, benchmarks, experiments, the planner, the command-line flag groups),
  ``specdec/serving/`` and ``specdec/cli/``: the tools, which nothing below them imports.

A new top module is API; a new folder fails the test until ``FOLDERS`` gives it a layer. Every import of a
``specdec`` module (module level or inside a function) must point to the same or a lower layer, a strategy
never imports another strategy, and no import cycle runs among a layer's modules (``CYCLE_FREE``).

The ``specdec`` command (``specdec/cli/``) is a leaf: no module of the package outside it, and no script of
``bench/`` or ``scripts/``, imports ``specdec.cli`` or a module of it; they take typed options
(``specdec.options``, the tools' option dataclasses) instead. ``specdec.tools.train.cli`` (and ``eagle_cli`` /
``medusa_cli``) is the training tool's own command line, not the ``specdec`` command: importing it is allowed."""
import ast
from pathlib import Path

import specdec

ROOT = Path(specdec.__file__).parent
SCRIPTS = [ROOT.parent / "bench", ROOT.parent / "scripts"]   # scripts that import specdec (not a package)

LAYERS = ["runtime", "speculation", "strategies", "api", "tools"]   # lowest first
API = "api"                                                          # the modules at the package's top
FOLDERS = {"core": "runtime", "speculation": "speculation", "fused": "speculation",
           "draft": "strategies", "eagle": "strategies", "medusa": "strategies", "lookup": "strategies",
           "suffix": "strategies", "tools": "tools", "serving": "tools", "cli": "tools"}
CYCLE_FREE = LAYERS     # every layer, the runtime included


def layer_of(module: str) -> int:
    """Layer index of a module name relative to the package ('core.decoder', 'eagle', 'generator', ...): its
    top folder's layer, the API for a module at the package's top."""
    head = module.split(".")[0]
    if not (ROOT / head).is_dir():
        return LAYERS.index(API)
    assert head in FOLDERS, f"specdec/{head}/ is in no layer: add it to FOLDERS"
    return LAYERS.index(FOLDERS[head])


def is_strategy(module: str) -> bool:
    head = module.split(".")[0]
    return (ROOT / head).is_dir() and FOLDERS.get(head) == "strategies"


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
    """'core.decoder' for specdec/core/decoder.py; a package is its folder's name ('cli'), the package
    itself '__init__' (the names ``imports_of`` gives)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def violations() -> list[str]:
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        me = module_name(path)
        if me == "__init__":
            continue   # the package's face re-exports the API layer
        for imported in imports_of(path):
            if layer_of(imported) > layer_of(me):
                bad.append(f"{me} ({LAYERS[layer_of(me)]}) imports {imported} ({LAYERS[layer_of(imported)]})")
            elif is_strategy(me) and is_strategy(imported) and imported.split(".")[0] != me.split(".")[0]:
                bad.append(f"strategy {me} imports strategy {imported}")
    return bad


def test_no_lower_layer_imports_a_higher_one():
    assert violations() == []


def test_every_folder_of_the_package_has_a_layer():
    folders = {p.parent.relative_to(ROOT).parts[0] for p in ROOT.glob("*/**/*.py")}
    assert folders - set(FOLDERS) == set() and set(FOLDERS) - folders == set(), folders ^ set(FOLDERS)
    assert set(FOLDERS.values()) <= set(LAYERS) and set(CYCLE_FREE) <= set(LAYERS)


def test_the_check_catches_an_upward_import(tmp_path, monkeypatch):
    """The walker sees relative and absolute, module-level and function-level imports; a module's layer
    comes from its folder, the package's top being the API."""
    fake = tmp_path / "specdec"
    for folder in ("core", "speculation", "eagle", "medusa", "tools/train"):
        (fake / folder).mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "core" / "__init__.py").write_text("")
    (fake / "core" / "bad.py").write_text("def f():\n    from ..speculation.speculative import Speculator\n")
    (fake / "speculation" / "speculative.py").write_text("from ..registry import strategy\n")
    (fake / "registry.py").write_text("")
    (fake / "eagle" / "x.py").write_text("import specdec.medusa.draft\nfrom specdec.tools.train import cli\n")
    (fake / "tools" / "train" / "cli.py").write_text("")
    monkeypatch.setattr(__import__(__name__), "ROOT", fake)
    found = violations()
    assert any("core.bad (runtime) imports speculation.speculative (speculation)" in v for v in found), found
    assert any("speculation.speculative (speculation) imports registry (api)" in v for v in found), found
    assert any("eagle.x (strategies) imports tools.train.cli (tools)" in v for v in found), found
    assert any("strategy eagle.x imports strategy medusa.draft" in v for v in found), found


def import_graph() -> dict[str, set[str]]:
    """Each module of the package → the package's modules it imports (module level or in a function)."""
    return {module_name(path): set(imports_of(path)) - {module_name(path)} for path in sorted(ROOT.rglob("*.py"))}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph``: its strongly connected components of more than one module (Tarjan's
    algorithm, iterative), each sorted."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next((m for m in edges if m in graph), None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def layer_cycles() -> list[str]:
    """The import cycles among modules of a layer of ``CYCLE_FREE`` (with the layering rule, every cycle
    lies within one layer)."""
    return [f"{LAYERS[layer_of(c[0])]}: {' -> '.join(c)}" for c in cycles(import_graph())
            if LAYERS[layer_of(c[0])] in CYCLE_FREE]


def test_no_import_cycle_within_a_layer():
    assert layer_cycles() == []


def test_the_check_catches_an_import_cycle(tmp_path, monkeypatch):
    """A cycle through a function-level import inside the tools layer (across its folders too) or inside a
    strategy is found; imports one way only are not a cycle."""
    fake = tmp_path / "specdec"
    for folder in ("tools/train", "serving", "cli", "lookup"):
        (fake / folder).mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "tools" / "train" / "data.py").write_text("from .distill import save\n")
    (fake / "tools" / "train" / "distill.py").write_text("def f():\n    from .data import load\n")
    (fake / "tools" / "train" / "store.py").write_text("from . import data\n")
    (fake / "serving" / "server.py").write_text("from ..tools.train import store\n")
    (fake / "cli" / "__init__.py").write_text("def main():\n    from .serve import run\n")
    (fake / "cli" / "serve.py").write_text("from ..serving import server\nfrom specdec.cli import main\n")
    (fake / "lookup" / "a.py").write_text("import specdec.lookup.b\n")
    (fake / "lookup" / "b.py").write_text("def f():\n    from . import a\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", fake)
    assert layer_cycles() == ["tools: cli -> cli.serve", "strategies: lookup.a -> lookup.b",
                              "tools: tools.train.data -> tools.train.distill"], layer_cycles()


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
    ``specdec.tools.train.cli`` and the command's own modules are not."""
    fake = tmp_path / "specdec"
    for folder in ("cli", "serving", "tools/train"):
        (fake / folder).mkdir(parents=True)
    (fake / "cli" / "__init__.py").write_text("from .generate import run\nfrom ..serving import server\n")
    (fake / "cli" / "generate.py").write_text("")
    (fake / "serving" / "server.py").write_text("def f():\n    from ..cli import build_parser\n")
    (fake / "tools" / "train" / "cli.py").write_text("")
    (fake / "tools" / "train" / "eagle_cli.py").write_text("from .cli import run\n"
                                                           "from specdec.tools.train import cli\n")
    (fake / "options.py").write_text("from . import cli\n")
    scripts = tmp_path / "bench"
    scripts.mkdir()
    (scripts / "bench_x.py").write_text("import specdec.cli.generate\nfrom specdec.tools.train.cli import run\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", fake)
    monkeypatch.setattr(__import__(__name__), "SCRIPTS", [scripts])
    found = cli_importers()
    assert found == [f"{scripts / 'bench_x.py'} imports specdec.cli.generate",
                     f"{fake / 'options.py'} imports specdec.cli",
                     f"{fake / 'serving' / 'server.py'} imports specdec.cli"], found

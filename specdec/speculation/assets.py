"""Where the shipped assets are: the trained drafts, heads, token store and request files for the embedded
SmolLM2-135M-Instruct live in their own distribution, ``specdec-assets`` (the ``assets/`` folder of the
repository, package ``specdec_assets``), versioned apart from the library; the library's wheel holds
code only. ``asset_path`` finds a file or folder in it by ``importlib.resources``.

Here rather than in ``specdec.core.paths`` (which finds the embedded model's GGUF the same way) only
because the strategies' loaders (``specdec.draft.smollm2``, ...) and the training tool both need it: the
speculation layer is the lowest both may import, and the module imports nothing of specdec."""
from __future__ import annotations

import importlib.resources
from pathlib import Path

PACKAGE = "specdec_assets"
INSTALL = "pip install -e ./assets"   # from the repository's root (the README's setup command does it)


def asset_path(*parts: str) -> Path:
    """The path of ``parts`` (e.g. ``"eagle", "smollm2-135m-instruct"``) in the installed ``specdec_assets``
    package; FileNotFoundError naming the install command when the distribution or the entry is missing."""
    try:
        entry = importlib.resources.files(PACKAGE)
    except ModuleNotFoundError:
        raise FileNotFoundError(f"the shipped weights and training data are not installed: run `{INSTALL}` "
                                "(the specdec-assets distribution in the repository's assets/ folder)") from None
    for part in parts:
        entry = entry.joinpath(part)
    path = Path(str(entry))
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the specdec-assets distribution: reinstall it "
                                f"(`{INSTALL}`)")
    return path

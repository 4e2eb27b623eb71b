"""The shipped assets (draft, EAGLE and Medusa weights, the token store, the training requests) are the
``specdec-assets`` distribution (``assets/``), not files of the library: the library's package holds code and
small configuration only, and finds the assets with ``importlib.resources`` (``asset_path``), failing with the
install command when they are missing."""
import fnmatch
from pathlib import Path

import pytest

import specdec
from specdec.speculation import assets
from specdec.speculation.assets import asset_path

ROOT = Path(specdec.__file__).parent
REPO = ROOT.parent
ASSETS = REPO / "assets"
ARRAYS = (".safetensors", ".npz", ".gguf", ".bin", ".pt", ".pth", ".npy")
MAX_DATA_BYTES = 128 * 1024   # a non-code file of the library larger than this belongs to the assets


def test_the_library_holds_no_weights_or_large_data():
    tomllib = pytest.importorskip("tomllib")   # Python >= 3.11
    files = [p for p in ROOT.rglob("*") if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".py"]
    assert [p for p in files if p.suffix in ARRAYS or p.stat().st_size > MAX_DATA_BYTES] == []
    package_data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert not any(s.endswith(ARRAYS) for patterns in package_data.values() for s in patterns), package_data


def test_the_assets_wheel_packs_every_asset():
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((ASSETS / "pyproject.toml").read_text())
    assert config["project"]["name"] == "specdec-assets"
    patterns = config["tool"]["setuptools"]["package-data"]["specdec_assets"]
    package = ASSETS / "specdec_assets"
    files = [p.relative_to(package).as_posix() for p in package.rglob("*")
             if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".py"]
    assert len(files) > 10 and [f for f in files if not any(fnmatch.fnmatch(f, s) for s in patterns)] == []


def test_the_shipped_strategies_and_training_data_are_found():
    from specdec.draft.smollm2 import shipped_draft_dir
    from specdec.eagle.smollm2 import shipped_eagle3_dir, shipped_eagle_dir
    from specdec.medusa.smollm2 import shipped_medusa_dir
    from specdec.tools.train.prompts import written_file
    from specdec.tools.train.store import embedded_store, shard_files

    for folder in (shipped_draft_dir(), shipped_eagle_dir(), shipped_eagle3_dir(), shipped_medusa_dir()):
        assert (folder / "config.json").is_file() and list(folder.glob("*.safetensors")), folder
        assert folder.is_relative_to(asset_path())
    assert written_file().is_file() and shard_files(embedded_store())


def test_missing_assets_name_the_install_command(monkeypatch):
    with pytest.raises(FileNotFoundError, match="is missing from the specdec-assets distribution"):
        asset_path("draft", "no-such-model")
    monkeypatch.setattr(assets, "PACKAGE", "specdec_assets_not_installed")
    with pytest.raises(FileNotFoundError, match=r"not installed: run `pip install -e \./assets`"):
        asset_path("draft")
    from specdec.registry import strategy
    with pytest.raises(FileNotFoundError, match=r"pip install -e \./assets"):
        strategy("medusa").weights()     # what shipped("medusa", target) loads first

"""The code a config's specs import from beside them, read from their import statements: the
same in every process, whatever it loaded before (a resumed run's fingerprint, a truth file's
identity)."""

from __future__ import annotations

import sys

from gradscope.config import load_config
from gradscope.io.code import config_code
from gradscope.io.files import file_sha256
from tests.project import edit_config, make_project


def test_the_factorys_imports_from_beside_it_transitively(tmp_path):
    config = make_project(tmp_path, model__factory="net.py:Net")
    (tmp_path / "net.py").write_text(
        "import torch\nfrom torch import nn\n\nimport helper\nfrom parts.blocks import Block\n\n"
        "class Net(nn.Module):\n    pass\n"
    )
    (tmp_path / "helper.py").write_text("SCALE = 1\n")
    (tmp_path / "parts").mkdir()
    (tmp_path / "parts" / "__init__.py").write_text("from . import shared\n")
    (tmp_path / "parts" / "shared.py").write_text("X = 1\n")
    (tmp_path / "parts" / "blocks.py").write_text(
        "from .shared import X\n\nclass Block:\n    pass\n"
    )
    (tmp_path / "unrelated.py").write_text("import helper\n")  # imported by nothing the run runs
    found = config_code(load_config(config))
    files = ["helper.py", "parts/__init__.py", "parts/blocks.py", "parts/shared.py"]
    assert found == {f: file_sha256(tmp_path / f) for f in files}


def test_a_package_modules_imports_from_the_folder_of_its_top_package(tmp_path, monkeypatch):
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "__init__.py").write_text("")
    (tmp_path / "proj" / "models.py").write_text("from proj.layers import Layer\n")
    (tmp_path / "proj" / "layers.py").write_text("class Layer:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "run").mkdir()
    config = make_project(tmp_path / "run", model__factory="proj.models:Net")
    try:
        found = set(config_code(load_config(config)))
        assert found == {"proj/__init__.py", "proj/models.py", "proj/layers.py"}
    finally:  # find_spec imported the package: no other test meets it
        sys.modules.pop("proj", None)


def test_an_installed_packages_code_is_not_the_projects(tmp_path):
    config = make_project(tmp_path)
    edit_config(tmp_path, lambda raw: raw["model"].update(factory="torch.nn:Linear"))
    assert config_code(load_config(config)) == {}

"""Every tutorial notebook runs top to bottom (its GPU steps say so and pass without a GPU)."""

import json
from pathlib import Path

import pytest

TUTORIALS = sorted((Path(__file__).resolve().parents[1] / "tutorials").glob("*.ipynb"))


@pytest.mark.parametrize("path", TUTORIALS, ids=[p.name for p in TUTORIALS])
def test_tutorial_runs(path, capsys):
    notebook = json.loads(path.read_text())
    namespace = {"__name__": "__tutorial__"}
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), f"{path.name}", "exec"), namespace)
    out = capsys.readouterr().out
    assert "rPrograms: 1" in out and "launches per inference: 1" in out
    assert "__global__" in out

"""Every tutorial notebook runs top to bottom in a real Jupyter kernel (nbclient).

Each notebook checks its own claims with ``assert`` in its cells, so a claim that stops being true
fails its cell, and a failing cell fails this test (with the cell and its traceback). GPU cells
take their other branch without a GPU and say what they would have done.
"""

import os
import re
from pathlib import Path

import pytest

# the test extras install both; a GPU host without them (no package index there) skips this file
# instead of failing the collection of every other test
nbformat = pytest.importorskip("nbformat", reason="pip install -e '.[test]' installs nbformat")
nbclient = pytest.importorskip("nbclient", reason="pip install -e '.[test]' installs nbclient")
NotebookClient = nbclient.NotebookClient
CellExecutionError = nbclient.exceptions.CellExecutionError

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = sorted((ROOT / "tutorials").glob("*.ipynb"))
CELL_TIMEOUT_S = 600  # a cell that hangs fails instead of blocking CI


def test_the_readme_lists_exactly_the_tutorials_there_are():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Tutorials\n", 1)[1].split("\n## ", 1)[0]
    listed = sorted(set(re.findall(r"\(tutorials/([\w.-]+\.ipynb)\)", section)))
    assert listed == [p.name for p in TUTORIALS] and len(listed) >= 4


@pytest.mark.parametrize("path", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_tutorial_is_valid_nbformat_with_cell_ids_and_no_stored_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)  # nbformat 4.5: every cell has a unique id
    assert (notebook.nbformat, notebook.nbformat_minor) >= (4, 5)
    ids = [cell.get("id") for cell in notebook.cells]
    assert all(ids) and len(set(ids)) == len(ids), ids
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code, "a tutorial without code"
    stored = [cell.id for cell in code if cell.outputs or cell.execution_count is not None]
    assert not stored, f"clear the outputs of cells {stored} (CI executes the notebooks)"


@pytest.mark.parametrize("path", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_tutorial_runs_top_to_bottom_in_a_kernel(path):
    notebook = nbformat.read(path, as_version=4)
    env = dict(os.environ)  # the test session's hermetic profile cache (conftest) included
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    client = NotebookClient(notebook, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT / "tutorials")}})
    try:
        client.execute(env=env)
    except CellExecutionError as err:
        plain = re.sub(r"\x1b\[[0-9;]*m", "", str(err))  # the kernel's traceback, without colours
        pytest.fail(f"{path.name}: a cell failed\n{plain}", pytrace=False)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(cell.execution_count is not None for cell in code), "a code cell did not run"

"""notebooks/trime_jax_demo.ipynb runs top to bottom on CPU with tiny parameters (a cell injected after the one
tagged `parameters`, as papermill does); any failing cell fails the test."""

import os

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(REPO, "notebooks", "trime_jax_demo.ipynb")
CI_PARAMETERS = """
STEPS = 3
TINY = True
MAX_FILES = 24
EVAL_TOKENS = 192
MEM_SIZES = (0, 128)
GEN_TOKENS = 8
"""


def test_notebook_runs_top_to_bottom(tmp_path, monkeypatch):
  nb = nbformat.read(NOTEBOOK, as_version=4)
  tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
  assert len(tagged) == 1, "the notebook needs exactly one cell tagged `parameters`"
  assert "colab.research.google.com/github/" in nb.cells[0].source  # the Open in Colab badge
  assert not any("find_spec(\"launch.generate\")" in c.source for c in nb.cells)  # generation is not optional
  nb.cells.insert(tagged[0] + 1, nbformat.v4.new_code_cell(CI_PARAMETERS, metadata={"tags": ["injected-parameters"]}))
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                   resources={"metadata": {"path": str(tmp_path)}})
  client.execute()  # raises CellExecutionError naming the cell if any cell fails

  def texts(kind):
    for cell in nb.cells:
      for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
          yield out.get("text", "")
        elif kind in out.get("data", {}):
          yield out["data"][kind]

  stream = "".join(texts("text/plain"))
  assert "backend: cpu" in stream and "reloaded:" in stream and "most likely next bytes" in stream
  assert "--- memory=none" in stream and "--- memory=local" in stream  # the generation cell ran
  table = "".join(texts("text/markdown"))
  assert "| TrimeLM | TRIME (local + long-term)" in table and "| vanilla LM | continuous cache" in table
  assert any(True for _ in texts("image/png"))  # the inline plot
  assert os.path.isdir(tmp_path / "runs" / "notebook" / "local" / "export" / "params")

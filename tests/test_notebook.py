"""notebooks/trime_jax_demo.ipynb runs top to bottom on CPU with tiny parameters (a cell injected after the one
tagged `parameters`, as papermill does); any failing cell fails the test. Its code has no placeholder a Colab user
would have to edit, and its install cell takes a URL, a wheel or a clone."""

import os
import re

import ipykernel  # noqa: F401  (the [test] extra installs the three: a missing one fails, not a skip)
import nbclient
import nbformat
import pytest

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
  assert "colab.research.google.com" in nb.cells[0].source  # the Open in Colab badge
  assert not any("find_spec(\"trime_jax.launch.generate\")" in c.source for c in nb.cells)  # generation is not optional
  nb.cells.insert(tagged[0] + 1, nbformat.v4.new_code_cell(CI_PARAMETERS, metadata={"tags": ["injected-parameters"]}))
  # As a user runs it: trime-jax installed, the kernel elsewhere than the repository root (Colab's /content), no
  # PYTHONPATH to the clone (with one, its top-level configs/ hid an install check that failed everywhere else)
  monkeypatch.delenv("PYTHONPATH", raising=False)
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
  # Training's progress bar is a widget (tqdm.auto + ipywidgets), not carriage-return text in a stream.
  train_cell = next(c for c in nb.cells if "train_and_evaluate(run_cfg" in c.source)
  assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in train_cell.outputs)
  assert os.path.isdir(tmp_path / "runs" / "notebook" / "local" / "export" / "params")


def _code_cells():
  return [c for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.cell_type == "code"]


def test_no_placeholder_in_code_cells():
  """A user runs every code cell as it is: nothing like `<org>`, `<your-repo>` or `YOUR_ORG` to fill in."""
  for cell in _code_cells():
    found = re.findall(r"<[A-Za-z][\w-]*>|\b(?:OWNER|YOUR_\w+|CHANGEME|TODO|FIXME)\b", cell.source)
    assert not found, f"placeholder {found} in code cell:\n{cell.source}"


def test_readme_badge_has_no_placeholder():
  with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
    badge = next(line for line in f if "colab-badge.svg" in line)
  assert not re.search(r"<[A-Za-z][\w-]*>", badge), badge


def test_install_cell_takes_a_url_a_wheel_or_a_clone(tmp_path, monkeypatch):
  """The install cell's source variable is the one setting (in the parameters cell); its pip arguments for each
  kind of source, and the uploaded wheel / clone it finds when the variable is empty."""
  cells = _code_cells()
  params = next(c for c in cells if "parameters" in c.metadata.get("tags", []))
  assert re.search(r'^TRIME_JAX_SOURCE = ""$', params.source, re.M)
  install = next(c for c in cells if "def install_args" in c.source)
  assert sum("TRIME_JAX_SOURCE =" in c.source for c in cells) == 1  # set in one place only
  monkeypatch.chdir(tmp_path)
  ns = {"TRIME_JAX_SOURCE": ""}
  exec(install.source, ns)  # trime_jax is importable here: the cell installs nothing  # noqa: S102
  install_args, found_source = ns["install_args"], ns["found_source"]
  assert install_args("https://github.com/someone/trime-jax") == [
      "trime-jax[notebook] @ git+https://github.com/someone/trime-jax"]
  assert install_args("git+https://github.com/someone/trime-jax@dev") == [
      "trime-jax[notebook] @ git+https://github.com/someone/trime-jax@dev"]
  wheel = tmp_path / "trime_jax-0.1.0-py3-none-any.whl"
  assert found_source() == ""  # nothing uploaded, no clone
  wheel.write_bytes(b"")
  assert found_source() == str(wheel)
  assert install_args(str(wheel)) == [f"trime-jax[notebook] @ file://{wheel}"]
  wheel.unlink()
  clone = tmp_path / "trime-jax"
  (clone / "trime_jax").mkdir(parents=True)
  (clone / "pyproject.toml").write_text("")
  assert found_source() == str(clone)
  assert install_args(str(clone)) == [f"{clone}[notebook]"]
  with pytest.raises(ValueError, match=r"^TRIME_JAX_SOURCE='no-such-thing' is neither a URL"):
    install_args("no-such-thing")

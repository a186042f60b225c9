"""One line per error, whatever the library raised: `errors.first_line` and the readers that quote it."""

import pytest

from trime_jax import data
from trime_jax.errors import DataError, first_line
from trime_jax.mt.data import SubwordVocab


def test_first_line():
  assert first_line(RuntimeError()) == "RuntimeError: "  # an empty message is not an IndexError
  assert first_line(ValueError("  \n")) == "ValueError: "
  assert first_line(OSError("first\nsecond")) == "OSError: first"
  assert first_line(KeyError("x" * 500)) == "KeyError: '" + "x" * 199


def test_truncated_json_names_the_file_and_the_parser_error(tmp_path):
  path = tmp_path / "meta.json"
  path.write_text('{"count": 3, "dimen')
  with pytest.raises(DataError) as e:
    data.read_json(str(path), "datastore metadata", DataError)
  assert str(e.value).startswith(f"datastore metadata {path} is corrupt or truncated (JSONDecodeError: ")
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("content,error", [('{"words": []}', "KeyError: 'tokens'"),
                                           ('{"tokens": [1', "JSONDecodeError: ")])
def test_damaged_subword_vocabulary_is_one_line(tmp_path, content, error):
  (tmp_path / SubwordVocab.FILES["bpe"]).write_text(content)
  with pytest.raises(DataError) as e:
    SubwordVocab.load(str(tmp_path))
  assert str(e.value).startswith(f"damaged vocabulary file in {tmp_path}: {error}")
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("failure", ["enospc", "short_write", "interrupt"])
def test_an_atomic_write_that_fails_leaves_nothing_and_names_the_file(tmp_path, monkeypatch, failure):
  """data.atomic_write_json / atomic_write_text / _atomic_npy (exports, workdir files, eval --output,
  translations, corpus caches): a write that fails removes its temporary file, leaves the target absent, and an
  OSError of the disk names the target (a failed write() names no file, and NumPy's short write has no errno:
  found with a file size limit on eval)."""
  import errno
  import json
  import os

  import numpy as np

  def fail(*a, **k):
    if failure == "enospc":
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if failure == "short_write":
      raise OSError("1000 requested and 234 written")
    raise KeyboardInterrupt

  class FailingText:  # a text file whose write() fails as `failure` says
    def __init__(self, path, *a, **k):
      self.f = open(path, *a, **k)

    def __enter__(self):
      return self

    def __exit__(self, *exc):
      self.f.close()

    def write(self, text):
      self.f.write(text[:1])
      fail()

  monkeypatch.setattr(json, "dump", fail)
  monkeypatch.setattr(np, "save", lambda file, *a, **k: (file.write(b"x"), fail()))  # _atomic_npy's open file
  monkeypatch.setattr(data, "open", FailingText, raising=False)  # atomic_write_text's (json's write is json.dump)
  for write, target in ((lambda p: data.atomic_write_json(p, {"a": 1}), tmp_path / "rows.json"),
                        (lambda p: data._atomic_npy(p, np.zeros(3)), tmp_path / "tokens.npy"),
                        (lambda p: data.atomic_write_text(p, "a translation\n"), tmp_path / "test.hyp")):
    with pytest.raises(KeyboardInterrupt if failure == "interrupt" else OSError) as e:
      write(str(target))
    assert os.listdir(tmp_path) == []  # no target, no temporary file
    if failure != "interrupt":
      assert e.value.errno == errno.ENOSPC and e.value.filename == str(target), e.value
      if failure == "short_write":
        assert "1000 requested and 234 written" in e.value.strerror


def test_a_metrics_line_the_disk_refuses_is_taken_back_out(tmp_path, monkeypatch):
  """runtime.workdir.MetricsFile: the disk takes part of a line, then refuses the rest (a file size limit, a full
  disk): the part is removed, so the resume's reader sees whole lines only, and the error names the file."""
  import errno
  import io

  from trime_jax.runtime import workdir

  path = tmp_path / "metrics.jsonl"
  metrics = workdir.MetricsFile(str(path))
  metrics.write({"step": 1, "loss": 2.5})
  before = path.read_bytes()

  class Filling(io.FileIO):  # takes 7 bytes of the next line, then EFBIG
    taken = 0

    def write(self, b):
      if Filling.taken >= 7:
        raise OSError(errno.EFBIG, "File too large")
      Filling.taken += 7
      return super().write(bytes(b)[:7])

  monkeypatch.setattr(workdir, "open", lambda p, mode, buffering: Filling(p, mode), raising=False)
  with pytest.raises(OSError) as e:
    metrics.write({"step": 2, "loss": 1.5})
  assert e.value.errno == errno.EFBIG and e.value.filename == str(path)
  assert path.read_bytes() == before
  monkeypatch.undo()
  assert metrics.rows() == [{"step": 1, "loss": 2.5}]


@pytest.mark.parametrize("reader", ["read_json", "batch_plan", "datastore", "faiss_sidecar"])
def test_json_of_another_kind_is_one_error_naming_the_file(tmp_path, reader):
  # Valid JSON that is not an object (a list: not a file this project wrote) was an AttributeError traceback in
  # the batch-plan and datastore readers (`.get` on a list).
  import numpy as np

  from trime_jax.batching import plan as batch_plan
  from trime_jax.datastore import Datastore
  from trime_jax.datastore import index as faiss_index
  from trime_jax.errors import CheckpointError

  if reader == "read_json":
    path = tmp_path / "meta.json"
    path.write_text("[1, 2]")
    call, error = (lambda: data.read_json(str(path), "datastore metadata", DataError, fix="rebuild it")), DataError
  elif reader == "batch_plan":
    path = tmp_path / "plan.json"
    path.write_text("[]")
    np.save(tmp_path / "batches.npy", np.zeros((1, 2), np.int64))
    call, error = (lambda: batch_plan.load(str(tmp_path))), DataError
  elif reader == "datastore":
    path = tmp_path / "meta.json"
    path.write_text('"a string"')
    call, error = (lambda: Datastore(str(tmp_path))), CheckpointError
  else:
    path = tmp_path / "index.faiss.json"
    (tmp_path / "index.faiss").write_bytes(b"")
    path.write_text("3")
    call, error = (lambda: faiss_index.KnnIndex.load(str(tmp_path / "index.faiss"))), CheckpointError
  with pytest.raises(error) as e:
    call()
  assert f"{path} holds a JSON " in str(e.value) and "not an object" in str(e.value)
  assert "\n" not in str(e.value)


def test_an_error_inside_a_progress_bar_starts_its_own_line():
  """A CLI whose error is raised while a tqdm bar is drawn (a reader, an index build): the bar is closed first,
  so `error:` starts a line instead of following the bar's carriage return."""
  import subprocess
  import sys

  script = ("from tqdm import tqdm\n"
            "from trime_jax.errors import DataError\n"
            "from trime_jax.launch import entry\n"
            "def main(argv):\n"
            "  tqdm(total=10, desc='reading').update(3)\n"
            "  raise DataError('the split is damaged')\n"
            "entry.run_main(main)\n")
  r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
  assert r.returncode == 2, r.stderr
  assert "3/10" in r.stderr and "\nerror: the split is damaged\n" in r.stderr
  assert [l for l in r.stderr.splitlines() if "error:" in l] == ["error: the split is damaged"]

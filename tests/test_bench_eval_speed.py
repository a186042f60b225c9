"""bench.eval_speed at tiny shapes on CPU: the rows it times, the JSON it writes, a config failing midway reported."""

import contextlib
import io
import json

import numpy as np
import pytest

from bench import eval_speed


@pytest.fixture(scope="module")
def result(tmp_path_factory):
  out = tmp_path_factory.mktemp("eval_speed") / "eval_speed.json"
  stdout = io.StringIO()
  with contextlib.redirect_stdout(stdout):
    # wiki103_150m: local, long-term (its 15,000-token store, 256 when tiny) and the key pass (a config that
    # does not exist is refused before any: tests/test_bench_flags.py; one failing midway: below)
    eval_speed.main(["--tiny", "--configs=wiki103_150m", "--tokens=384", "--key_pass_tokens=300", f"--out={out}"])
  result = json.loads(out.read_text())
  result["stdout"] = stdout.getvalue()
  return result


def test_rows(result):
  [ok] = result["results"]
  assert result["bench"] == "eval_speed" and ok["config"] == "wiki103_150m" and "error" not in ok
  rows = ok["rows"]
  assert set(rows) == {"eval_local", "eval_long", "key_pass"}
  for name, r in rows.items():
    assert r["seconds"] > 0 and r["tokens_per_s"] == pytest.approx(r["tokens"] / r["seconds"]), name
  assert rows["eval_local"]["tokens"] == rows["eval_long"]["tokens"] == 384
  assert rows["eval_long"]["mem_size"] == 256
  assert rows["key_pass"]["tokens"] >= 300 and rows["key_pass"]["bytes_per_key"] == ok["d_model"] * 2
  # the same model on the same tokens: the store changes the memory family only
  local, long = rows["eval_local"]["ppl"], rows["eval_long"]["ppl"]
  assert local["none"] == pytest.approx(long["none"], rel=1e-5)
  assert local["trime_local"] != pytest.approx(long["trime_local"], rel=1e-5)


def test_rows_measured_before_a_failure_are_kept(tmp_path, monkeypatch):
  """A config that fails (or is cut at its budget) part-way keeps the rows it measured, in the JSON as well: the
  JSON is rewritten after every row."""
  out = tmp_path / "eval_speed.json"
  written = []

  def failing_key_pass(*args, **kw):
    written.append(json.loads(out.read_text()))  # what a kill at this moment would leave
    raise MemoryError("the key pass did not fit")

  monkeypatch.setattr(eval_speed.ds_build, "build_datastore", failing_key_pass)
  with contextlib.redirect_stdout(io.StringIO()) as stdout:
    eval_speed.main(["--tiny", "--configs=wiki103_150m", "--tokens=256", "--mem_size=64", f"--out={out}"])
  [entry] = json.loads(out.read_text())["results"]
  assert set(entry["rows"]) == {"eval_local", "eval_long"} and entry["error"].startswith("MemoryError")
  assert set(written[0]["results"][0]["rows"]) == {"eval_local", "eval_long"}
  assert "| wiki103_150m | eval_long | 64 |" in stdout.getvalue()
  assert "| wiki103_150m | failed: MemoryError: the key pass did not fit |" in stdout.getvalue()


def test_synthetic_corpus():
  vocab = eval_speed.synthetic_vocab(50, "words")
  corpus = eval_speed.synthetic_corpus(vocab, 10_000, line_len=20)
  ends = np.flatnonzero(corpus.tokens == vocab.eos)
  lengths = np.diff(np.concatenate([[-1], ends]))
  assert len(ends) > 200 and lengths.max() <= 40  # every line ends in </s>, none longer than 2 x line_len
  assert corpus.doc_starts[0] == 0 and corpus.doc_starts[-1] == 10_000
  assert np.all(np.diff(corpus.doc_starts)[:-1] == eval_speed.DOC_TOKENS)

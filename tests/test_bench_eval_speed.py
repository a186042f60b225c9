"""bench.eval_speed at tiny shapes on CPU: the rows it times, the JSON it writes, a failing config reported."""

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
    # wiki103_150m: local, long-term (its 15,000-token store, 256 when tiny) and the key pass; a config that
    # does not exist first: its failure is reported and the run goes on
    eval_speed.main(["--tiny", "--configs=no_such_config,wiki103_150m", "--tokens=384", "--key_pass_tokens=300",
                     f"--out={out}"])
  result = json.loads(out.read_text())
  result["stdout"] = stdout.getvalue()
  return result


def test_rows(result):
  failed, ok = result["results"]
  assert failed["config"] == "no_such_config" and failed["error"].startswith("ModuleNotFoundError")
  assert "| no_such_config | failed: ModuleNotFoundError: " in result["stdout"]
  assert ok["config"] == "wiki103_150m" and "error" not in ok
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


def test_synthetic_corpus():
  vocab = eval_speed.synthetic_vocab(50, "words")
  corpus = eval_speed.synthetic_corpus(vocab, 10_000, line_len=20)
  ends = np.flatnonzero(corpus.tokens == vocab.eos)
  lengths = np.diff(np.concatenate([[-1], ends]))
  assert len(ends) > 200 and lengths.max() <= 40  # every line ends in </s>, none longer than 2 x line_len
  assert corpus.doc_starts[0] == 0 and corpus.doc_starts[-1] == 10_000
  assert np.all(np.diff(corpus.doc_starts)[:-1] == eval_speed.DOC_TOKENS)

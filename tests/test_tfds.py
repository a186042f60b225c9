"""TFDS builders (trime_jax/tfds_builders): built from manual dirs, read as array_record without TensorFlow, and
equal to the plain readers (tokens, document boundaries, vocabulary) through `corpora.load_splits`."""

import contextlib
import functools
import http.server
import os
import sys
import threading
import zipfile

import numpy as np
import pytest
import tensorflow_datasets  # noqa: F401  (the [test] extra installs it: a missing one fails here, not a skip)

from trime_jax.configs import default
from trime_jax import corpora, tfds_builders
from trime_jax import data as D
from trime_jax.errors import ConfigError, DataError

WT2 = os.path.join(corpora.REPO_ROOT, "..", "shared", "data", "wikitext-2")  # valid + test files only


def _data_cfg(**kw):
  c = default.get_config().data
  c.update(kw)
  return c


def _same_splits(a: corpora.Splits, b: corpora.Splits):
  assert a.vocab.tokens == b.vocab.tokens and a.vocab.kind == b.vocab.kind
  for s in corpora.SPLITS:
    x, y = a.get(s), b.get(s)
    np.testing.assert_array_equal(np.asarray(x.tokens), np.asarray(y.tokens))
    np.testing.assert_array_equal(x.doc_starts, y.doc_starts)


def test_wikitext2_from_shared_manual_dir_equals_plain_reader(tmp_path):
  """The shared dir has valid + test only: those splits are built (and equal the plain reader's articles); the
  absent train split is a clear error, not an empty split."""
  data_dir = str(tmp_path / "tfds")
  b = tfds_builders.prepare("wikitext2", data_dir, WT2)
  assert set(b.info.splits) == {"validation", "test"}
  for split, fn in (("validation", "wiki.valid.tokens"), ("test", "wiki.test.tokens")):
    docs = tfds_builders.documents("wikitext2", split, data_dir)
    plain = D.read_wikitext_articles(os.path.join(WT2, fn))
    assert len(docs) == len(plain) > 50 and docs == plain  # tokens and article boundaries
    assert D.Vocab.build(docs, 2).tokens == D.Vocab.build(plain, 2).tokens
  titles = [b.as_data_source("validation")[i]["title"] for i in range(2)]
  assert [t.decode() if isinstance(t, bytes) else t for t in titles] == ["Homarus gammarus", "Frank <unk>"]
  with pytest.raises(DataError, match="no 'train' split"):
    tfds_builders.documents("wikitext2", "train", data_dir)
  with pytest.raises(DataError, match="no 'train' split"):
    corpora.load_splits(_data_cfg(corpus="tfds:wikitext2", path=WT2, tfds_data_dir=data_dir))
  # wikitext_mini without ../shared (a fresh clone: its default path missing) takes the same 124 articles from
  # the TFDS build.
  # what would download is told before (train --dry_run's memory plan refuses it): a prepared build, or a manual
  # dir, would not
  assert not corpora.would_download(_data_cfg(corpus="tfds:wikitext2", path="", tfds_data_dir=data_dir))
  assert not corpora.would_download(_data_cfg(corpus="tfds:wikitext103", path=WT2, tfds_data_dir=data_dir))
  assert corpora.would_download(_data_cfg(corpus="tfds:wikitext103", path="", tfds_data_dir=data_dir))
  with _without_shared(tmp_path):
    fallback = corpora.load_splits(_data_cfg(corpus="wikitext_mini", path=corpora.WIKITEXT_MINI_PATH,
                                             tfds_data_dir=data_dir))
  _same_splits(fallback, corpora.load_splits(_data_cfg(corpus="wikitext_mini", path=WT2)))
  assert not any(m == "tensorflow" or m.startswith("tensorflow.") for m in sys.modules)  # built and read without TF


@contextlib.contextmanager
def _without_shared(tmp_path):
  """wikitext_mini's default data.path as on a clone without ../shared: it resolves to a folder that is not there
  (only a missing default path falls back to TFDS; a path of one's own is an error)."""
  real = corpora.resolve_path
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(corpora, "resolve_path", lambda p: str(tmp_path / "absent") if p == corpora.WIKITEXT_MINI_PATH
               else real(p))
    yield


def test_tfds_wikitext_corpus_equals_wikitext_reader(tmp_path, monkeypatch):
  """`data.corpus="tfds:wikitext2"` gives the `wikitext` reader's corpora (vocabulary from train, <unk> below
  min_count), from the token files or from the released zip in the manual dir, or downloaded."""
  manual = tmp_path / "manual"
  manual.mkdir()
  for dst, src in (("train", "valid"), ("valid", "test"), ("test", "valid")):
    os.symlink(os.path.join(WT2, f"wiki.{src}.tokens"), manual / f"wiki.{dst}.tokens")
  plain = corpora.load_splits(_data_cfg(corpus="wikitext", path=str(manual), vocab_min_count=2))
  via_tfds = corpora.load_splits(_data_cfg(corpus="tfds:wikitext2", path=str(manual), vocab_min_count=2,
                                           tfds_data_dir=str(tmp_path / "tfds")))
  _same_splits(via_tfds, plain)
  assert via_tfds.train.num_docs == 60 and via_tfds.vocab.unk in np.asarray(via_tfds.train.tokens)
  zipped = tmp_path / "zipped"
  zipped.mkdir()
  with zipfile.ZipFile(zipped / "wikitext-2-v1.zip", "w") as z:
    for s in ("train", "valid", "test"):
      z.write(manual / f"wiki.{s}.tokens", f"wikitext-2/wiki.{s}.tokens")
  _same_splits(corpora.load_splits(_data_cfg(corpus="tfds:wikitext2", path=str(zipped), vocab_min_count=2,
                                             tfds_data_dir=str(tmp_path / "tfds_zip"))), plain)
  # Online: no manual dir, the zip downloaded over HTTP (from a local server: tests never use the network).
  handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(zipped))
  handler.log_message = lambda *a: None
  with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(tfds_builders._builders()["wikitext2"], "URL",
                        f"http://127.0.0.1:{server.server_address[1]}/wikitext-2-v1.zip")
    downloaded = corpora.load_splits(_data_cfg(corpus="tfds:wikitext2", vocab_min_count=2,
                                               tfds_data_dir=str(tmp_path / "tfds_dl")))
    server.shutdown()
  _same_splits(downloaded, plain)
  assert not any(m == "tensorflow" or m.startswith("tensorflow.") for m in sys.modules)


def test_enwik8_standard_split_in_chunks(tmp_path, monkeypatch):
  """enwik8: train = all but the last 2 holdouts (5M each in the real file, 100k here), read back in order across
  1 MiB chunks; equal to the `bytes` reader with the matching fractions; from the file or from enwik8.zip."""
  monkeypatch.setattr(tfds_builders._builders()["enwik8"], "HOLDOUT", 100_000)
  raw = np.random.default_rng(0).integers(0, 256, 1_300_000, dtype=np.uint8).tobytes()  # not valid UTF-8
  manual = tmp_path / "manual"
  manual.mkdir()
  (manual / "enwik8").write_bytes(raw)
  splits = corpora.load_splits(_data_cfg(corpus="tfds:enwik8", path=str(manual), tfds_data_dir=str(tmp_path / "t")))
  assert [len(splits.get(s)) for s in corpora.SPLITS] == [1_100_000, 100_000, 100_000]
  assert b"".join(np.asarray(splits.get(s).tokens, np.uint8).tobytes() for s in corpora.SPLITS) == raw
  plain = corpora.load_splits(_data_cfg(corpus="bytes", path=str(manual / "enwik8"), split_fractions=(11, 1, 1)))
  _same_splits(splits, plain)
  assert splits.vocab.kind == "bytes" and len(splits.vocab) == 256
  zipped = tmp_path / "zipped"
  zipped.mkdir()
  with zipfile.ZipFile(zipped / "enwik8.zip", "w") as z:
    z.writestr("enwik8", raw)
  _same_splits(corpora.load_splits(_data_cfg(corpus="tfds:enwik8", path=str(zipped),
                                             tfds_data_dir=str(tmp_path / "tz"))), plain)
  assert tfds_builders.ENWIK8_HOLDOUT == 5_000_000  # the real split: 90M / 5M / 5M of 10^8 bytes


def test_tfds_errors_are_one_line(tmp_path, monkeypatch, capfd):
  with pytest.raises(ConfigError, match="tfds:wikitext103"):
    corpora.load_splits(_data_cfg(corpus="tfds:wikitext3"))
  with pytest.raises(DataError, match="manual dir for wikitext2 not found"):
    corpora.load_splits(_data_cfg(corpus="tfds:wikitext2", path=str(tmp_path / "nope"),
                                  tfds_data_dir=str(tmp_path / "t")))
  empty = tmp_path / "empty_manual"
  (empty / "other").mkdir(parents=True)
  with pytest.raises(DataError, match="neither wikitext-2-v1.zip nor wiki"):
    corpora.load_splits(_data_cfg(corpus="tfds:wikitext2", path=str(empty), tfds_data_dir=str(tmp_path / "t")))
  # the failed build's dataset folders are gone (later reads warned about a version folder without its info)
  assert not (tmp_path / "t" / "wikitext2").exists()

  def offline(url):
    raise DataError(f"could not download {url} (offline)")

  monkeypatch.setattr(tfds_builders, "_probe", offline)  # no network in tests, whatever the machine has
  with _without_shared(tmp_path), pytest.raises(
      DataError, match=r"not found: data.path='../shared/data/wikitext-2'.*could not download https://wikitext"):
    corpora.load_splits(_data_cfg(corpus="wikitext_mini", path=corpora.WIKITEXT_MINI_PATH,
                                  tfds_data_dir=str(tmp_path / "t2")))
  # Said before TFDS starts its build (its "Downloading and preparing" line came first): offline, a manual dir
  # given but empty (TFDS took it for none and downloaded), enwik8's manual dir without its file (it downloaded)
  capfd.readouterr()
  with pytest.raises(DataError, match=r"^could not download http://mattmahoney.net/dc/enwik8.zip \(offline\)$"):
    tfds_builders.prepare("enwik8", str(tmp_path / "t3"))
  (tmp_path / "bare").mkdir()
  with pytest.raises(DataError, match=rf"^manual dir for wikitext2 is empty: {tmp_path}/bare; put the released "
                                      r"wikitext-\*-v1.zip, .* \(or give none to download the release\)$"):
    tfds_builders.prepare("wikitext2", str(tmp_path / "t3"), manual_dir=str(tmp_path / "bare"))
  with pytest.raises(DataError, match=rf"^manual dir {empty} has neither enwik8.zip nor enwik8$"):
    tfds_builders.prepare("enwik8", str(tmp_path / "t3"), manual_dir=str(empty))
  assert capfd.readouterr() == ("", "") and not (tmp_path / "t3").exists()


def test_a_dry_run_does_not_download(tmp_path):
  """train --dry_run reads the vocabulary size from the training split: a corpus that would be downloaded for it
  is one error naming prepare_data (it started TFDS's download), and nothing is written."""
  from tests.helpers import run_cli

  r = run_cli("trime_jax.launch.train", "--config=configs/wikitext_mini.py", "--config.data.corpus=tfds:wikitext103",
              "--config.data.path=", f"--config.data.tfds_data_dir={tmp_path / 'tfds'}", "--dry_run")
  assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
      "error: the memory plan reads the vocabulary size from the training split, and data.corpus='tfds:wikitext103' "
      "is not prepared here (it would be downloaded): prepare it first (python -m trime_jax.launch.prepare_data "
      f"--corpus=wikitext103 --data_dir={tmp_path / 'tfds'}) or give --config.model.vocab_size=N"), r.stderr
  assert not (tmp_path / "tfds").exists()


def test_prepare_data_cli(tmp_path):
  """`python -m trime_jax.launch.prepare_data` builds from a manual dir and names the splits; a bad dir is one error
  line."""
  import subprocess

  env = {**os.environ, "PYTHONPATH": corpora.REPO_ROOT}
  r = subprocess.run([sys.executable, "-m", "trime_jax.launch.prepare_data", "--corpus=tfds:wikitext2",
                      f"--manual_dir={WT2}", f"--data_dir={tmp_path}"], capture_output=True, text=True, env=env,
                     cwd=corpora.REPO_ROOT, timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  assert "wikitext2 test: 62 articles" in r.stdout and "wikitext2 validation: 60 articles" in r.stdout
  assert "--config.data.corpus=tfds:wikitext2" in r.stdout
  assert "note: no train split" in r.stdout and "reused" not in r.stdout  # ../shared's WikiText-2: valid + test
  again = subprocess.run([sys.executable, "-m", "trime_jax.launch.prepare_data", "--corpus=wikitext2",
                          f"--manual_dir={WT2}", f"--data_dir={tmp_path}"], capture_output=True, text=True, env=env,
                         cwd=corpora.REPO_ROOT, timeout=300)
  assert again.returncode == 0 and "reused the build already in" in again.stdout, again.stderr[-2000:]
  assert "(every one of its 122 records read back;" in again.stdout
  # a damaged build (a test file cut to half): prepare_data refuses to reuse it, reading it is one DataError
  # (it was "reused" and "built", then a Riegeli RuntimeError's traceback when read)
  import glob

  from trime_jax import tfds_builders
  from trime_jax.errors import DataError

  shard = glob.glob(os.path.join(str(tmp_path), "wikitext2", "*", "wikitext2-test.array_record*"))[0]
  os.truncate(shard, os.path.getsize(shard) // 2)
  again = subprocess.run([sys.executable, "-m", "trime_jax.launch.prepare_data", "--corpus=wikitext2",
                          f"--manual_dir={WT2}", f"--data_dir={tmp_path}"], capture_output=True, text=True, env=env,
                         cwd=corpora.REPO_ROOT, timeout=300)
  last = again.stderr.strip().splitlines()[-1]
  assert again.returncode == 2 and last.startswith(f"error: TFDS dataset wikitext2 in {os.path.dirname(shard)}: "), last
  assert last.endswith("the build is damaged: delete that directory and rebuild it") and "built in" not in again.stdout
  with pytest.raises(DataError, match=r"of test cannot be read \(RuntimeError: .*the build is damaged"):
    tfds_builders.documents("wikitext2", "test", str(tmp_path))
  r = subprocess.run([sys.executable, "-m", "trime_jax.launch.prepare_data", "--corpus=enwik8",
                      f"--manual_dir={tmp_path}/no", f"--data_dir={tmp_path}"], capture_output=True, text=True, env=env,
                     cwd=corpora.REPO_ROOT, timeout=300)
  assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: manual dir for enwik8 not found")
  # a manual dir without the release's files: the one error line alone (TFDS's "Downloading and preparing" line
  # and its warnings about the empty build's folder came first), and no folder of the build is left
  (tmp_path / "other_files").mkdir()
  (tmp_path / "other_files" / "notes.txt").write_text("x")
  r = subprocess.run([sys.executable, "-m", "trime_jax.launch.prepare_data", "--corpus=wikitext103",
                      f"--manual_dir={tmp_path}/other_files", f"--data_dir={tmp_path}/t103"], capture_output=True,
                     text=True, env=env, cwd=corpora.REPO_ROOT, timeout=300)
  assert r.returncode == 2 and r.stderr.strip().splitlines() == [
      f"error: manual dir {tmp_path}/other_files has neither wikitext-103-v1.zip nor wiki.*.tokens files (in it or "
      "in wikitext-103/)"], r.stderr
  assert not (tmp_path / "t103" / "wikitext103").exists()


def test_a_damaged_record_is_said_as_damage_and_nothing_else_is():
  """What a damaged array_record file raises (Riegeli's RuntimeError, a read's OSError) is one DataError saying
  to rebuild; a missing module, a permission or memory is not the build's fault and passes as it is (it was
  told to delete the build too)."""
  from trime_jax import tfds_builders
  from trime_jax.errors import DataError

  class Source:
    def __init__(self, error):
      self.error = error

    def __len__(self):
      return 1

    def __getitem__(self, i):
      raise self.error

  class Build:
    data_dir = "/data/wikitext2/1.0.0"

    def __init__(self, error, at_open=False):
      self.error, self.at_open = error, at_open

    def as_data_source(self, split):
      if self.at_open:
        raise self.error
      return Source(self.error)

  for at_open in (False, True):
    with pytest.raises(DataError, match=r"^TFDS dataset wikitext2 in /data/wikitext2/1.0.0: .* cannot be read "
                                        r"\(RuntimeError: Corrupted Riegeli/records file\); the build is damaged"):
      list(tfds_builders._records("wikitext2", Build(RuntimeError("Corrupted Riegeli/records file"), at_open), "test"))
    for error in (PermissionError(13, "Permission denied"), ImportError("no array_record"), MemoryError()):
      with pytest.raises(type(error)):
        list(tfds_builders._records("wikitext2", Build(error, at_open), "test"))

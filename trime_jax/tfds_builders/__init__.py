"""The paper's corpora as tensorflow-datasets builders, written and read as `array_record` (no TensorFlow).

  wikitext103  WikiText-103 v1 (word level, `<unk>` as released): one example per article
  wikitext2    WikiText-2 v1, the same layout
  enwik8       the first 10^8 bytes of English Wikipedia: 90M / 5M / 5M bytes, in 1 MiB chunks

Each downloads its released archive from the public source when the machine is online, or reads the released
files from a manual dir (`data.path`) when it is not: for WikiText the `.zip` or the `wiki.{train,valid,test}.tokens`
files (directly in the dir or in its `wikitext-103/` / `wikitext-2/` folder); for enwik8 `enwik8.zip` or the
unzipped `enwik8`. A WikiText split whose token file is absent is left out of the dataset (the splits that exist are
built, with a warning); reading an absent split is a clear `DataError`.

A config names one as `data.corpus="tfds:wikitext103"` (`tfds:wikitext2`, `tfds:enwik8`); `corpora.py` turns the
splits into the same `Corpus`es as the plain readers (articles split at ` = Title = ` lines exactly as
`data.read_wikitext_articles`, `</s>` at every line end; enwik8 one document per split, as the `bytes` corpus).

  from trime_jax import tfds_builders
  tfds_builders.prepare("wikitext2", data_dir="~/tensorflow_datasets", manual_dir="")   # download + build once
  docs = tfds_builders.documents("wikitext2", "validation")                              # [[word, ..., </s>], ...]
  tfds_builders.iter_documents("wikitext103", "train")                                   # one article at a time
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import zipfile

import numpy as np

from trime_jax import data
from trime_jax.errors import DataError, first_line

# Public sources of the released files (the original s3 bucket now answers 403; its owner serves them here).
WIKITEXT_URLS = {"wikitext103": "https://wikitext.smerity.com/wikitext-103-v1.zip",
                 "wikitext2": "https://wikitext.smerity.com/wikitext-2-v1.zip"}
ENWIK8_URL = "http://mattmahoney.net/dc/enwik8.zip"
WIKITEXT_FILES = {"train": "wiki.train.tokens", "validation": "wiki.valid.tokens", "test": "wiki.test.tokens"}
ENWIK8_HOLDOUT = 5_000_000  # bytes of dev and of test: the standard 90M / 5M / 5M split
ENWIK8_CHUNK = 1 << 20  # bytes per example (array_record reads stay small)
NAMES = ("wikitext103", "wikitext2", "enwik8")
SPLIT_NAMES = {"train": "train", "dev": "validation", "test": "test"}  # corpora.SPLITS -> TFDS split names


def import_tfds():
  try:
    import tensorflow_datasets as tfds  # noqa: PLC0415 - optional dependency, imported when a tfds: corpus is used
  except ImportError:
    raise DataError("data.corpus='tfds:...' needs tensorflow-datasets: pip install 'trime-jax[tfds]'") from None
  return tfds


def wikitext_article_lines(path: str, member: str = "") -> list[list[str]]:
  """Lines (without '\\n') of each article of a WikiText token file (or of `member` of the zip at `path`): split
  exactly where `data.read_wikitext_articles` splits (a ` = Title = ` line after some text)."""
  data.require_file(path, "WikiText token file")
  articles, current, has_text = [], [], False
  with _open_text(path, member) as f:
    for line in f:
      line = line.rstrip("\n")
      if data.TITLE.match(line) and has_text:
        articles.append(current)
        current, has_text = [], False
      current.append(line)
      has_text = has_text or any(w != data.EOS for w in line.split())
  if current:
    articles.append(current)
  return articles


@contextlib.contextmanager
def _open_text(path: str, member: str = ""):
  """A text file, or a zip member read the same way (utf-8, universal newlines), without extracting it: TFDS's
  extractor needs TensorFlow."""
  if not member:
    with open(path, encoding="utf-8") as f:
      yield f
    return
  with zipfile.ZipFile(path) as z, io.TextIOWrapper(z.open(member), encoding="utf-8") as f:
    yield f


def article_words(text: str) -> list[str]:
  """An article's stored text as the plain reader's word list: whitespace tokens, `</s>` at every line end."""
  words = []
  for line in text.split("\n"):
    words.extend(line.split())
    words.append(data.EOS)
  return words


def _builders():
  """The builder classes, defined on first use (tensorflow_datasets is optional; defining registers them)."""
  global _BUILDERS
  if _BUILDERS is not None:
    return _BUILDERS
  tfds = import_tfds()
  from etils import epath  # noqa: PLC0415 - a tensorflow-datasets dependency

  _HERE = epath.Path(os.path.dirname(os.path.abspath(__file__)))

  class _WikiText(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    VERSION = tfds.core.Version("1.0.0")
    # TFDS finds a builder's files (checksums, metadata) through its top-level package, which fails for the
    # namespace package trime_jax: name them here.
    code_path, pkg_dir_path = _HERE / "__init__.py", _HERE
    RELEASE_NOTES = {"1.0.0": "Articles of the v1 (tokenized, <unk>) release, split at ' = Title = ' lines."}
    MANUAL_DOWNLOAD_INSTRUCTIONS = ("Put the released wikitext-*-v1.zip, or its wiki.{train,valid,test}.tokens "
                                    "files, in the manual dir.")
    ZIP_DIR = ""
    URL = ""

    def _info(self):
      return tfds.core.DatasetInfo(
          builder=self,
          features=tfds.features.FeaturesDict({
              "index": np.int64,  # article number in the file (the corpus keeps this order)
              "title": tfds.features.Text(),  # the article's ` = Title = ` line, trimmed
              "text": tfds.features.Text(),  # the article's lines joined with '\n', exactly as released
          }),
          disable_shuffling=True,
          homepage="https://blog.salesforceairesearch.com/the-wikitext-long-term-dependency-language-modeling-dataset/",
          citation="Merity, Xiong, Bradbury and Socher. Pointer Sentinel Mixture Models. ICLR 2017.")

    def _split_generators(self, dl_manager):
      sources = _wikitext_sources(dl_manager, self.ZIP_DIR, self.URL)
      missing = sorted(set(WIKITEXT_FILES) - set(sources))
      if missing:
        from absl import logging  # noqa: PLC0415

        logging.warning("%s: no %s in the source: building only the splits %s", self.name,
                        ", ".join(WIKITEXT_FILES[s] for s in missing), sorted(sources))
      return {s: self._generate_examples(src) for s, src in sources.items()}

    def _generate_examples(self, src):
      for i, lines in enumerate(wikitext_article_lines(*src)):
        title = next((l for l in lines if data.TITLE.match(l)), "")
        yield i, {"index": i, "title": title.strip().strip("=").strip(), "text": "\n".join(lines)}

  class Wikitext103(_WikiText):
    """WikiText-103 v1: 28,475 training articles, 103M tokens, 267k vocabulary."""
    ZIP_DIR, URL = "wikitext-103", WIKITEXT_URLS["wikitext103"]

  class Wikitext2(_WikiText):
    """WikiText-2 v1: 600 training articles, 2.1M tokens, 33k vocabulary."""
    ZIP_DIR, URL = "wikitext-2", WIKITEXT_URLS["wikitext2"]

  class Enwik8(tfds.core.GeneratorBasedBuilder):
    """enwik8 (Hutter Prize): bytes, train = all but the last 10M, dev and test the last 5M each."""
    VERSION = tfds.core.Version("1.0.0")
    code_path, pkg_dir_path = _HERE / "__init__.py", _HERE
    RELEASE_NOTES = {"1.0.0": "The standard 90M / 5M / 5M byte split, in 1 MiB chunks."}
    MANUAL_DOWNLOAD_INSTRUCTIONS = "Put enwik8.zip, or the unzipped enwik8 file, in the manual dir."
    HOLDOUT, URL = ENWIK8_HOLDOUT, ENWIK8_URL

    def _info(self):
      return tfds.core.DatasetInfo(
          builder=self,
          features=tfds.features.FeaturesDict({
              "index": np.int64,  # chunk number within the split
              "bytes": tfds.features.Tensor(shape=(None,), dtype=np.uint8, encoding=tfds.features.Encoding.BYTES),
          }),
          disable_shuffling=True,
          homepage="http://mattmahoney.net/dc/textdata.html",
          citation="Mahoney. Large Text Compression Benchmark. 2011.")

    def _split_generators(self, dl_manager):
      manual = _manual_files(dl_manager)
      if "enwik8" in manual:
        path = manual["enwik8"]
      else:
        path = manual.get("enwik8.zip") or _download(dl_manager, self.URL)
      raw = _read_enwik8(str(path))
      n = len(raw)
      if n <= 2 * self.HOLDOUT:
        raise DataError(f"enwik8 file {path} has {n:,} bytes: fewer than the {2 * self.HOLDOUT:,} held out")
      cuts = {"train": (0, n - 2 * self.HOLDOUT), "validation": (n - 2 * self.HOLDOUT, n - self.HOLDOUT),
              "test": (n - self.HOLDOUT, n)}
      return {s: self._generate_examples(raw, a, b) for s, (a, b) in cuts.items()}

    def _generate_examples(self, raw, start, stop):
      for i, a in enumerate(range(start, stop, ENWIK8_CHUNK)):
        yield i, {"index": i, "bytes": np.frombuffer(raw[a:min(a + ENWIK8_CHUNK, stop)], np.uint8)}

  _BUILDERS = {"wikitext103": Wikitext103, "wikitext2": Wikitext2, "enwik8": Enwik8}
  return _BUILDERS


_BUILDERS = None


def _manual_files(dl_manager) -> dict:
  """{file name: path} of the manual dir's files (and of its wikitext-*/ folders), {} when it is absent."""
  try:
    root = dl_manager.manual_dir
  except AssertionError:  # no manual dir (TFDS says so of an empty one too, which `prepare` refused): download
    return {}
  out = {}
  for p in sorted(root.iterdir()):
    out.setdefault(p.name, p)
  return out


def _wikitext_sources(dl_manager, zip_dir: str, url: str) -> dict:
  """{split: (path,) or (zip path, member)} of the token files that exist: in the manual dir (or its `zip_dir`/
  folder, or its released zip), else in the downloaded zip."""
  files = _manual_files(dl_manager)
  if files:
    found = _manual_wikitext(str(next(iter(files.values())).parent), zip_dir)
    if isinstance(found, dict):
      return found
    archive = found
  else:
    archive = _download(dl_manager, url)
  with zipfile.ZipFile(archive) as z:
    names = set(z.namelist())
  found = {s: (archive, f"{zip_dir}/{f}") for s, f in WIKITEXT_FILES.items() if f"{zip_dir}/{f}" in names}
  if not found:
    raise DataError(f"{archive} has no {zip_dir}/wiki.*.tokens files")
  return found


def _manual_wikitext(root: str, zip_dir: str):
  """A (non-empty) manual dir's WikiText: {split: (path,)} of its token files (in it or in its `zip_dir`/
  folder), else the path of its released zip; a DataError when it has neither."""
  for d in (root, os.path.join(root, zip_dir)):
    found = {s: (os.path.join(d, f),) for s, f in WIKITEXT_FILES.items() if os.path.isfile(os.path.join(d, f))}
    if found:
      return found
  archive = os.path.join(root, f"{zip_dir}-v1.zip")
  if not os.path.exists(archive):
    raise DataError(f"manual dir {root} has neither {zip_dir}-v1.zip nor wiki.*.tokens files "
                    f"(in it or in {zip_dir}/)")
  return archive


def _probe(url: str) -> None:
  """A DataError unless `url`'s host takes a connection within 5 s: offline, TFDS's download manager would retry
  for minutes (and `prepare` asks before TFDS starts, so the error is the only line)."""
  import socket
  import urllib.parse

  u = urllib.parse.urlsplit(url)
  try:
    socket.create_connection((u.hostname, u.port or (443 if u.scheme == "https" else 80)), timeout=5).close()
  except OSError as e:
    raise DataError(f"could not download {url}: {u.hostname} is unreachable ({type(e).__name__}: {e}); offline, "
                    "put the released file(s) in a directory and pass it: prepare_data --manual_dir=DIR, or "
                    "data.path") from None


def _download(dl_manager, url: str) -> str:
  """The downloaded file (not extracted: TFDS's extractor needs TensorFlow; zips are read with zipfile)."""
  _probe(url)
  try:
    return str(dl_manager.download(url))
  except Exception as e:  # noqa: BLE001 - offline, DNS, HTTP errors all mean: use a manual dir
    raise DataError(f"could not download {url} ({first_line(e)}); offline, put the released file(s) in a "
                    "directory and pass it: prepare_data --manual_dir=DIR, or data.path") from None


def _read_enwik8(path: str) -> bytes:
  if zipfile.is_zipfile(path):
    with zipfile.ZipFile(path) as z:
      return z.read("enwik8")
  with open(path, "rb") as f:
    return f.read()


def builder(name: str, data_dir: str = "", **kwargs):
  """The named builder over `data_dir` (default: TFDS's, $TFDS_DATA_DIR or ~/tensorflow_datasets)."""
  classes = _builders()
  if name not in classes:
    raise DataError(f"unknown TFDS corpus {name!r}; choose one of {NAMES}")
  return classes[name](data_dir=os.path.expanduser(data_dir) if data_dir else None, file_format="array_record",
                       **kwargs)


def is_prepared(b) -> bool:
  """The builder's files are written (TFDS warns about a version folder without its info when asked about one
  that does not exist: it is not asked then)."""
  return os.path.isdir(b.data_dir) and b.is_prepared()


def _check_source(name: str, b, manual_dir: str) -> None:
  """A DataError when the build could not read its source: a manual dir that is missing, empty (TFDS would take
  it for none and download) or lacks the release's files, or, with none given, a download host out of reach."""
  if not manual_dir:
    _probe(b.URL)
  elif not os.path.isdir(manual_dir):
    raise DataError(f"manual dir for {name} not found: {manual_dir}")
  elif not os.listdir(manual_dir):
    raise DataError(f"manual dir for {name} is empty: {manual_dir}; {b.MANUAL_DOWNLOAD_INSTRUCTIONS[:1].lower()}"
                    f"{b.MANUAL_DOWNLOAD_INSTRUCTIONS[1:-1]} (or give none to download the release)")
  elif getattr(b, "ZIP_DIR", ""):
    _manual_wikitext(manual_dir, b.ZIP_DIR)
  elif not any(os.path.isfile(os.path.join(manual_dir, f)) for f in ("enwik8", "enwik8.zip")):
    raise DataError(f"manual dir {manual_dir} has neither enwik8.zip nor enwik8")


def prepare(name: str, data_dir: str = "", manual_dir: str = "", **kwargs):
  """Download (or read `manual_dir`) and write the array_record files once; returns the builder."""
  tfds = import_tfds()
  b = builder(name, data_dir, **kwargs)
  if not is_prepared(b):
    _check_source(name, b, manual_dir)  # what would fail inside TFDS's build is said before its first line
    cfg = tfds.download.DownloadConfig(manual_dir=manual_dir or None)
    # The dataset's folders this build makes (<data_dir>/<name>/<version>): removed again when it fails, so a
    # failed build leaves no skeleton that later reads warn about (its downloads, beside them, are kept)
    made, folder, root = [], os.path.abspath(b.data_dir), os.path.abspath(b.data_dir_root)
    while folder.startswith(root + os.sep) and not os.path.exists(folder):
      made.append(folder)
      folder = os.path.dirname(folder)
    try:
      b.download_and_prepare(download_config=cfg, file_format="array_record")
    except BaseException:
      if made:
        shutil.rmtree(made[-1], ignore_errors=True)
      raise
  return b


def iter_documents(name: str, split: str, data_dir: str = "", manual_dir: str = "", **kwargs):
  """A split's documents in corpus order, one at a time (WikiText-103's word lists never all at once): word
  lists (`</s>` at line ends) for WikiText, or for enwik8 one `bytes` object (the split's bytes)."""
  b = prepare(name, data_dir, manual_dir, **kwargs)
  if split not in b.info.splits:
    raise DataError(f"TFDS dataset {name} in {b.data_dir} has no {split!r} split (its source had no file for it; "
                    f"splits: {', '.join(sorted(b.info.splits))}); delete that directory and rebuild from the full "
                    "release")
  if name == "enwik8":
    yield b"".join(np.asarray(r["bytes"], np.uint8).tobytes() for r in _records(name, b, split))
    return
  for r in _records(name, b, split):
    yield article_words(_text(r["text"]))


def _records(name: str, b, split: str):
  """The split's records in order, each checked: readable (a truncated or altered array_record file fails
  Riegeli's chunk hashes: one DataError, not its RuntimeError) and holding its own index."""
  damaged = lambda where, e: DataError(
      f"TFDS dataset {name} in {b.data_dir}: {where} cannot be read ({type(e).__name__}: "
      f"{(str(e).splitlines() or [''])[0][:200]}); the build is damaged: delete that directory and rebuild it")
  # What a damaged file raises: Riegeli's RuntimeError (chunk hashes), an OSError of the read. Not a missing
  # module, a permission (a shared read-only directory) or memory: those are not the build's fault.
  try:
    source = b.as_data_source(split=split)
    count = len(source)
  except PermissionError:
    raise
  except (RuntimeError, OSError) as e:
    raise damaged(f"the {split} split", e) from None
  for i in range(count):  # written unshuffled, in generation order; the stored index proves it
    try:
      r = source[i]
    except PermissionError:
      raise
    except (RuntimeError, OSError) as e:
      raise damaged(f"record {i} of {split}", e) from None
    if int(r["index"]) != i:
      raise DataError(f"TFDS dataset {name} in {b.data_dir}: record {i} of {split} holds document "
                      f"{int(r['index'])}; rebuild it (delete that directory)")
    yield r


def check_build(name: str, b) -> int:
  """Read every record of every split of a build (a reused one is checked before it is said to be fine):
  the records read, or one DataError naming the damage."""
  return sum(1 for split in sorted(b.info.splits) for _ in _records(name, b, split))


def documents(name: str, split: str, data_dir: str = "", manual_dir: str = "", **kwargs) -> list:
  """`iter_documents` as a list."""
  return list(iter_documents(name, split, data_dir, manual_dir, **kwargs))


def _text(value) -> str:
  return value.decode("utf-8") if isinstance(value, (bytes, np.bytes_)) else str(value)

"""The original's BM25 search run on a real corpus, for tests/test_bm25_lucene.py (see tests/oracle/README.md).

  # 1. (trime-jax's environment) each training segment of the config as the original's
  #    `train.py --output-segments-to-file` writes it: {"id": i, "contents": its input words, end-of-sentence
  #    symbols dropped (fairseq's Dictionary.string of src_tokens)}; and the corpus's vocabulary, one word a line
  python tests/oracle/dump_bm25_lucene.py segments --config=configs/wikitext_mini_ext.py --out=$W
  # 2. (Pyserini 0.22.1 with Java 11+) the original's README commands, as they are
  python -m pyserini.index.lucene --collection JsonCollection --input $W/segments --index $W/bm25_index \
      --generator DefaultLuceneDocumentGenerator --threads 1 --storePositions --storeDocvectors --storeRaw
  python $TRIME/bm25_search.py --index_path $W/bm25_index/ --segments_path $W/segments/segments.json \
      --results_path $W/bm25_results
  python tests/oracle/dump_bm25_lucene.py analyze --out=$W --more=$MORE  # Lucene's analysis of the words, its lengths
  python tests/oracle/dump_bm25_lucene.py codepoints --out=trime_jax/batching/lucene_chars.py  # its token chars
  # 3. (trime-jax's environment) the fixture
  python tests/oracle/dump_bm25_lucene.py fixture --out=$W --fixture=tests/fixtures/oracle/bm25_lucene_wikitext_mini.npz

  # MT (the release's machine_translation/ scripts): the first 4,000 target sentences of ui-de-en
  python tests/oracle/dump_bm25_lucene.py mt_samples --data=../shared/data/ui-de-en/train.en --out=$M
  python -m pyserini.index.lucene --collection JsonCollection --input $M/samples --index $M/bm25_index \
      --generator DefaultLuceneDocumentGenerator --threads 1 --storePositions --storeDocvectors --storeRaw
  python $TRIME/machine_translation/bm25_search.py --index_path $M/bm25_index/ \
      --samples_path $M/samples/samples.json --results_path $M/bm25_results
  python tests/oracle/dump_bm25_lucene.py mt_fixture --out=$M --fixture=tests/fixtures/oracle/bm25_lucene_ui_de_en.npz
"""

import argparse
import json
import os
import sys


def segments(config_path, out):
  import importlib.util

  import numpy as np

  from trime_jax import corpora, data

  spec = importlib.util.spec_from_file_location("cfg", config_path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  config = mod.get_config()
  train = corpora.load_splits(config.data).train
  segs = data.make_segments(train, int(config.data.segment_len), config.data.segmentation)
  words, eos, toks = train.vocab.tokens, train.vocab.eos, np.asarray(train.tokens)
  rows = []
  for i, (s, n) in enumerate(zip(segs.start.tolist(), segs.length.tolist())):
    src = toks[max(s - 1, 0):s + n - 1]  # inputs: targets shifted right by one (the first input is </s>)
    rows.append({"id": i, "contents": " ".join(words[t] for t in src.tolist() if t != eos)})
  os.makedirs(os.path.join(out, "segments"), exist_ok=True)
  with open(os.path.join(out, "segments", "segments.json"), "w") as f:
    json.dump(rows, f)
  with open(os.path.join(out, "vocab.txt"), "w", encoding="utf-8") as f:
    f.write("\n".join(words) + "\n")
  print(f"{len(rows)} segments of {config.data.segment_len}, {len(words)} words -> {out}")


def analyze(out, more):
  """Lucene's analysis of every vocabulary word (and of the words of `more`, a file of one word a line, where
  given), and Lucene's one-byte document lengths (SmallFloat) of 0 .. 2^20 and some larger."""
  from pyserini.analysis import Analyzer, get_lucene_analyzer  # Anserini's DefaultEnglishAnalyzer
  from pyserini.pyclass import autoclass

  analyzer = Analyzer(get_lucene_analyzer())
  words = open(os.path.join(out, "vocab.txt"), encoding="utf-8").read().split("\n")[:-1]
  if more:
    words += [w for w in open(more, encoding="utf-8").read().split("\n")[:-1] if w not in set(words)]
  with open(os.path.join(out, "analysis.json"), "w", encoding="utf-8") as f:
    json.dump({"words": words, "terms": [analyzer.analyze(w) for w in words]}, f)
  small_float = autoclass("org.apache.lucene.util.SmallFloat")
  lengths = list(range(1 << 20)) + [3 << 20, 100_000_000, 2**31 - 1]
  with open(os.path.join(out, "lengths.json"), "w") as f:
    json.dump({"lengths": lengths, "norms": [small_float.intToByte4(n) & 0xFF for n in lengths],
               "decoded": [small_float.byte4ToInt(b) for b in range(-128, 128)]}, f)


def mt_samples(data, n, out):
  """The original MT's `--output-samples-to-file` for the first n training pairs of a text-format corpus: each
  target sentence's detokenised text (fairseq's target string, subwords joined, Moses-detokenised), which for raw
  text is the line itself (trime-jax's ParallelData.tgt_text)."""
  with open(data, encoding="utf-8") as f:
    lines = f.read().split("\n")[:n]
  os.makedirs(os.path.join(out, "samples"), exist_ok=True)
  with open(os.path.join(out, "samples", "samples.json"), "w") as f:
    json.dump([{"id": i, "contents": t} for i, t in enumerate(lines)], f)
  print(f"{len(lines)} target sentences of {data} -> {out}")


def mt_fixture(out, path):
  import numpy as np

  with open(os.path.join(out, "bm25_results", "shard0.json")) as f:
    results = sorted(json.load(f), key=lambda r: int(r["id"]))
  hits = np.full((len(results), 20), -1, np.int32)
  for r in results:
    hits[int(r["id"]), :len(r["retrieval"])] = r["retrieval"]  # (the MT script's ids are ints already)
  np.savez_compressed(path, hits=hits)
  print(f"{path}: hits {hits.shape}")


def codepoints(path):
  """trime_jax/batching/lucene_chars.py: the code points StandardTokenizer keeps as (part of) a token when
  one stands alone between spaces, as ranges (Lucene's own Unicode tables, older than Python's)."""
  from pyserini.analysis import Analyzer, get_lucene_analyzer

  analyzer = Analyzer(get_lucene_analyzer(stemming=False, stopwords=False))
  ranges = []
  for cp in range(0x110000):
    if 0xD800 <= cp <= 0xDFFF or len(analyzer.analyze("x " + chr(cp) + " x")) == 2:
      continue
    if ranges and ranges[-1][1] == cp - 1:
      ranges[-1][1] = cp
    else:
      ranges.append([cp, cp])
  lines = [" ".join(f"{a:x}-{b:x}" for a, b in ranges[i:i + 8]) for i in range(0, len(ranges), 8)]
  with open(path, "w") as f:
    f.write('"""Code points Lucene\'s StandardTokenizer (Lucene 9.5, through Pyserini 0.22.1) makes a token of,\n'
            'as hexadecimal ranges: written by tests/oracle/dump_bm25_lucene.py codepoints (batching/lucene.py)."""\n\n'
            'RANGES = """\n' + "\n".join(lines) + '\n"""\n')
  print(f"{path}: {len(ranges)} ranges")


def fixture(out, path):
  import numpy as np

  with open(os.path.join(out, "bm25_results", "shard0.json")) as f:
    results = json.load(f)
  hits = np.full((len(results), 20), -1, np.int64)
  for r in results:
    got = [int(d) for d in r["retrieval"]]
    hits[int(r["id"]), :len(got)] = got
  analysis = json.load(open(os.path.join(out, "analysis.json"), encoding="utf-8"))
  lengths = json.load(open(os.path.join(out, "lengths.json")))
  byte_of = np.asarray([b & 0xFF for b in range(-128, 128)])  # Java's signed bytes, as unsigned
  table = np.zeros(256, np.int64)
  table[byte_of] = lengths["decoded"]
  def utf8(lines):  # one UTF-8 text, a line each (smaller than a NumPy string array)
    return np.frombuffer("\n".join(lines).encode("utf-8"), np.uint8)

  np.savez_compressed(path, hits=hits, words=utf8(analysis["words"]),
                      terms=utf8(" ".join(t) for t in analysis["terms"]),
                      norms=np.asarray(lengths["norms"][:1 << 20], np.uint8),  # of the lengths 0 .. 2^20 - 1
                      large_lengths=np.asarray(lengths["lengths"][1 << 20:], np.int64),
                      large_norms=np.asarray(lengths["norms"][1 << 20:], np.uint8), length_table=table)
  print(f"{path}: hits {hits.shape}, {len(analysis['words'])} analysed words")


if __name__ == "__main__":
  p = argparse.ArgumentParser()
  p.add_argument("mode", choices=["segments", "analyze", "codepoints", "fixture", "mt_samples", "mt_fixture"])
  p.add_argument("--data", help="mt_samples: the target side of the training pairs (e.g. train.en)")
  p.add_argument("--n", type=int, default=4000, help="mt_samples: how many pairs")
  p.add_argument("--config")
  p.add_argument("--out", required=True)
  p.add_argument("--fixture")
  p.add_argument("--more", help="analyze: a file of more words to analyse, one a line")
  a = p.parse_args()
  {"segments": lambda: segments(a.config, a.out), "analyze": lambda: analyze(a.out, a.more),
   "codepoints": lambda: codepoints(a.out), "fixture": lambda: fixture(a.out, a.fixture),
   "mt_samples": lambda: mt_samples(a.data, a.n, a.out), "mt_fixture": lambda: mt_fixture(a.out, a.fixture)}[a.mode]()
  sys.exit(0)

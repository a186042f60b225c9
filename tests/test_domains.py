"""Document selection by source package (docs-wt's docs.tsv): a held-out domain for the large-corpus and
domain-adaptation experiments (configs/docs_wt*.py)."""

import json
import os

import pytest

from trime_jax.configs import default
from trime_jax import corpora
from trime_jax import data as D
from trime_jax.errors import ConfigError, DataError

DOCS_WT = os.path.join(os.path.dirname(corpora.REPO_ROOT), "shared", "data", "docs-wt")

# split -> [(package, title, body words)]
TINY = {
    "train": [("kern", "Locks", "spinlock mutex kernel"), ("py", "Lists", "list append python"),
              ("kern", "Irq", "interrupt kernel handler"), ("py", "Dicts", "dict python keys")],
    "valid": [("py", "Sets", "set python add"), ("kern", "Mm", "page kernel fault")],
    "test": [("kern", "Sched", "runqueue kernel task"), ("py", "Str", "string python join")],
}


def _write_tiny(root, tsv_rows=None):
  os.makedirs(root, exist_ok=True)
  rows = ["split\tdoc_index\tpackage\ttitle"]
  for split, docs in TINY.items():
    with open(os.path.join(root, f"wiki.{split}.tokens"), "w") as f:
      for i, (pkg, title, body) in enumerate(docs):
        f.write(f" = {title} = \n\n {body} \n\n")
        rows.append(f"{split}\t{i}\t{pkg}\t{title}")
  with open(os.path.join(root, "docs.tsv"), "w") as f:
    f.write("\n".join(tsv_rows if tsv_rows is not None else rows) + "\n")
  return root


def _cfg(root, **kw):
  c = default.get_config().data
  c.corpus, c.path = "wikitext", str(root)
  for k, v in kw.items():
    setattr(c, k, v)
  return c


def _words(corpus):
  return {corpus.vocab.tokens[t] for t in corpus.tokens}


def test_exclude_and_only_select_documents_and_the_vocabulary_is_the_kept_training_documents(tmp_path):
  root = _write_tiny(tmp_path / "wt")
  full = corpora.load_splits(_cfg(root))
  held_out = corpora.load_splits(_cfg(root, exclude_packages=("kern",)))
  domain = corpora.load_splits(_cfg(root, only_packages=("kern",)), vocab=held_out.vocab)
  assert (full.train.num_docs, held_out.train.num_docs, domain.train.num_docs) == (4, 2, 2)
  assert (held_out.dev.num_docs, held_out.test.num_docs, domain.dev.num_docs, domain.test.num_docs) == (1, 1, 1, 1)
  assert "kernel" in full.vocab.tokens and "kernel" not in held_out.vocab.tokens  # train documents only
  assert {"python", "append", "dict"} <= _words(held_out.train) and not {"kernel", "mutex"} & _words(held_out.train)
  assert "kernel" not in _words(domain.test) and "<unk>" in _words(domain.test)  # new-domain words: <unk>
  assert {"runqueue", "task"} & set(full.test.vocab.tokens) == set()  # test words never enter a vocabulary
  assert domain.vocab.fingerprint() == held_out.vocab.fingerprint()


def test_bad_package_selections_are_one_clear_error(tmp_path):
  root = _write_tiny(tmp_path / "wt")
  with pytest.raises(ConfigError, match=r"data.exclude_packages: unknown package\(s\) \['kenrel'\]"):
    corpora.load_splits(_cfg(root, exclude_packages=("kenrel",)))
  with pytest.raises(DataError, match="no train documents left"):
    corpora.load_splits(_cfg(root, exclude_packages=("kern", "py")))
  os.remove(os.path.join(root, "docs.tsv"))
  with pytest.raises(DataError, match="need a docs.tsv beside the token files"):
    corpora.load_splits(_cfg(root, only_packages=("kern",)))
  rows = ["split\tdoc_index\tpackage\ttitle", "train\t0\tkern\tLocks"]  # another corpus's table
  root2 = _write_tiny(tmp_path / "wt2", tsv_rows=rows)
  with pytest.raises(DataError, match="lists 1 train documents, the token file has 4"):
    corpora.load_splits(_cfg(root2, only_packages=("kern",)))


def test_docs_wt_held_out_kernel_documentation_matches_the_corpus_statistics():
  """The real table: dev/test documents per package after holding out linux-doc-6.1 equal stats.json's."""
  with open(os.path.join(DOCS_WT, "stats.json")) as f:
    stats = json.load(f)
  articles = {s: D.read_wikitext_articles(os.path.join(DOCS_WT, f"wiki.{t}.tokens"))
              for s, t in (("dev", "valid"), ("test", "test"))}
  tsv = os.path.join(DOCS_WT, "docs.tsv")
  kept = corpora.select_packages(articles, tsv, exclude=("linux-doc-6.1",))
  kernel = corpora.select_packages(articles, tsv, only=("linux-doc-6.1",))
  for split, name in (("dev", "valid"), ("test", "test")):
    per_pkg = stats[name]["per_package_docs"]
    assert len(kernel[split]) == per_pkg["linux-doc-6.1"] > 0
    assert len(kept[split]) == sum(per_pkg.values()) - per_pkg["linux-doc-6.1"]


def test_docs_wt_configs_validate_and_hold_out_the_same_domain():
  from trime_jax.configs import docs_wt, docs_wt_ext, docs_wt_kernel, docs_wt_long
  from trime_jax import train

  cfgs = {m.__name__: m.get_config() for m in (docs_wt, docs_wt_long, docs_wt_ext, docs_wt_kernel)}
  for c in cfgs.values():
    train.validate_config(c)
  held_out = cfgs["trime_jax.configs.docs_wt_kernel"].data.only_packages
  assert held_out == ("linux-doc-6.1",) and cfgs["trime_jax.configs.docs_wt_kernel"].data.exclude_packages == ()
  for name in ("trime_jax.configs.docs_wt", "trime_jax.configs.docs_wt_long", "trime_jax.configs.docs_wt_ext"):
    assert cfgs[name].data.exclude_packages == held_out and cfgs[name].data.only_packages == ()
    assert cfgs[name].train.num_steps * cfgs[name].train.batch_size * cfgs[name].data.segment_len == 4_915_200
  assert (cfgs["trime_jax.configs.docs_wt_long"].trime.memory,
          cfgs["trime_jax.configs.docs_wt_ext"].trime.memory) == ("long", "ext")


def test_a_package_selection_on_a_corpus_without_docs_tsv_is_an_error_not_ignored(tmp_path):
  """Only the wikitext reader reads docs.tsv; the others dropped data.only_packages / exclude_packages silently,
  so a "held-out domain" on wikitext_mini or bytes trained on every document."""
  raw = tmp_path / "bytes.txt"
  raw.write_bytes(b"some text to split into three parts " * 20)
  c = default.get_config().data
  c.corpus, c.path, c.split_fractions = "bytes", str(raw), (0.8, 0.1, 0.1)
  assert len(corpora.load_splits(c).train) > 0
  c.exclude_packages = ("linux-doc-6.1",)
  with pytest.raises(ConfigError, match=r"data.exclude_packages selects documents by source package .* needs "
                                        r"data.corpus='wikitext', got 'bytes'"):
    corpora.load_splits(c)
  wt2 = _cfg(os.path.join(os.path.dirname(corpora.REPO_ROOT), "shared", "data", "wikitext-2"))
  wt2.corpus, wt2.only_packages = "wikitext_mini", ("kern",)
  with pytest.raises(ConfigError, match="data.only_packages selects .* got 'wikitext_mini'"):
    corpora.load_splits(wt2)


def test_a_package_both_kept_and_held_out_is_an_error_and_names_are_checked_before_reading(tmp_path, monkeypatch):
  root = _write_tiny(tmp_path / "wt")
  with pytest.raises(ConfigError, match=r"only_packages and data.exclude_packages both name \['kern'\]"):
    corpora.load_splits(_cfg(root, only_packages=("kern", "py"), exclude_packages=("kern",)))
  # a misspelt name is reported before the token files are read (WikiText-103-sized ones take a minute), with
  # the closest package
  monkeypatch.setattr(corpora, "_iter_articles", lambda *a, **k: pytest.fail("read the corpus first"))
  with pytest.raises(ConfigError, match=r"unknown package\(s\) \['kernn'\] \(did you mean 'kern'\?\); .* lists 2: "
                                        r"kern, py$"):
    corpora.load_splits(_cfg(root, exclude_packages=("kernn",)))


def test_docs_wt_training_and_new_domain_splits_are_disjoint_and_deterministic():
  """configs/docs_wt*.py (kernel held out) and docs_wt_kernel.py (kernel only) select complementary documents
  of every split, in file order, the same on every call."""
  articles = {s: D.read_wikitext_articles(os.path.join(DOCS_WT, f"wiki.{t}.tokens"))
              for s, t in corpora.TSV_SPLITS.items()}
  tsv = os.path.join(DOCS_WT, "docs.tsv")
  n = {s: len(a) for s, a in articles.items()}
  kept = corpora.package_selection(n, tsv, exclude=("linux-doc-6.1",))
  kernel = corpora.package_selection(n, tsv, only=("linux-doc-6.1",))
  assert kept == corpora.package_selection(n, tsv, exclude=("linux-doc-6.1",))
  for s in corpora.SPLITS:
    assert kept[s] == sorted(kept[s]) and kernel[s] == sorted(kernel[s])
    assert not set(kept[s]) & set(kernel[s]) and len(kept[s]) + len(kernel[s]) == n[s]

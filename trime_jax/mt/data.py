"""Parallel text for translation: a subword vocabulary and sentence pairs.

Two input formats give the same `ParallelData`:

* `data.format="text"`: plain aligned files `{split}.{src}` / `{split}.{tgt}` (raw, untokenised UTF-8, line i
  of one translates line i of the other), e.g. ../shared/data/ui-de-en. The project trains a joint
  sentencepiece model on the training source + target text (reproducibly: fixed options, one thread, no
  sampling) and caches it under `data.cache_dir` keyed by the text's digest and the options.
* `data.format="fairseq"`: the output of fairseq's `prepare-iwslt14.sh` (`train/valid/test.{de,en}`, Moses-
  tokenised and BPE'd with `@@ ` continuations). The vocabulary is the BPE tokens themselves, built from train
  (most frequent first), one dictionary of both sides or, `data.dictionaries="separate"`, one per side as
  fairseq's preprocess builds them (`load_vocab`); a reference's token outside the target dictionary reads
  `<<unk>>`, as the original prints its references; detokenisation removes `@@ ` and then undoes Moses's tokenisation
  (sacremoses's MosesDetokenizer of each side's language: `&apos;` back to `'`, `it 's` to `it's`), from the
  hypotheses (`ParallelData.text`) and from the pairs' texts (`ParallelData.src_text` / `tgt_text`, the BLEU
  references) alike: the original README's `--tokenizer moses --remove-bpe --scoring sacrebleu`, so BLEU is
  sacrebleu's 13a on detokenised text, the numbers it reports (32.58 / 33.15 / 33.73). Until 2026-12-06 the Moses
  step was not applied: BLEU compared tokenised text, where 13a splits `&apos;` into three tokens that match
  easily, higher than the original's number.

Ids: pad 0, unk 1, bos 2, eos 3 in both. fairseq's conventions for a pair (x, y):
    source  = x + [eos]            (encoder input, `collate`)
    prev    = [eos] + y            (decoder input)
    targets = y + [eos]            (padding targets are -1: never scored, never memory)
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import io
import json
import logging
import os

import numpy as np

from trime_jax.errors import ConfigError, DataError, first_line

PAD, UNK, BOS, EOS = 0, 1, 2, 3
SPECIALS = ("<pad>", "<unk>", "<s>", "</s>")
SPLITS = ("train", "valid", "test")


def split_name(split: str) -> str:
  """The translation split a command's --split names: "dev" (the language models' name) is "valid"."""
  return "valid" if split == "dev" else split


FORMATS = ("text", "fairseq")
DICTIONARIES = ("joint", "separate")  # data.dictionaries (format fairseq): one for both sides, or one per side


class SubwordVocab:
  """A subword vocabulary: a sentencepiece model (`kind="spm"`) or a fixed BPE token list (`kind="bpe"`).

  One id space for both sides. A BPE list may hold two dictionaries in it (data.dictionaries="separate", as
  fairseq's preprocess builds one per side): the target side's tokens are ids [0, target_size) (the decoder's
  vocabulary, `MTConfig.tgt_vocab_size`), and `source_unseen` are ids of that range never seen on the source
  side; `encode_target` / `encode_source` map a token outside its side's dictionary to <unk>, as fairseq
  does."""

  FILES = {"spm": "spm.model", "bpe": "bpe_vocab.json"}
  pad_id, unk_id, bos_id, eos_id = PAD, UNK, BOS, EOS

  def __init__(self, *, spm_proto: bytes | None = None, tokens: list[str] | None = None, target_size: int = 0,
               source_unseen=()):
    if (spm_proto is None) == (tokens is None):
      raise ValueError("SubwordVocab needs exactly one of spm_proto, tokens")
    if spm_proto is not None:
      import sentencepiece as spm

      self.kind, self.proto = "spm", bytes(spm_proto)
      self.sp = spm.SentencePieceProcessor(model_proto=self.proto)
      ids = (self.sp.pad_id(), self.sp.unk_id(), self.sp.bos_id(), self.sp.eos_id())
      if ids != (PAD, UNK, BOS, EOS):
        raise DataError(f"sentencepiece model has special ids (pad, unk, bos, eos) = {ids}, expected (0, 1, 2, 3)")
      self.size = int(self.sp.get_piece_size())
    else:
      if tuple(tokens[:4]) != SPECIALS:
        raise DataError(f"BPE vocabulary must start with {SPECIALS}")
      self.kind, self.tokens = "bpe", list(tokens)
      self.index = {t: i for i, t in enumerate(self.tokens)}
      self.size = len(self.tokens)
    if (target_size or source_unseen) and self.kind != "bpe":
      raise ValueError("separate dictionaries (target_size, source_unseen) are of a BPE token list")
    self.target_size = int(target_size) or self.size
    if not 4 <= self.target_size <= self.size:
      raise DataError(f"vocabulary target_size {self.target_size} outside [4, {self.size}]")
    self.source_unseen = np.asarray(sorted(int(i) for i in source_unseen), np.int64)
    if len(self.source_unseen) and not (self.source_unseen.min() >= 4 and self.source_unseen.max() < self.size):
      raise DataError("vocabulary source_unseen ids outside the tokens")
    self._source_known = np.ones(self.size, bool)  # encode_source's lookup
    self._source_known[self.source_unseen] = False

  @property
  def separate(self) -> bool:
    """Two dictionaries (data.dictionaries="separate") rather than one joint one."""
    return self.target_size != self.size or len(self.source_unseen) > 0

  def encode_target(self, ids: np.ndarray) -> np.ndarray:
    """Target-side ids: a token outside the target dictionary is <unk>."""
    return np.where(ids < self.target_size, ids, UNK).astype(np.int32) if self.separate else ids

  def encode_source(self, ids: np.ndarray) -> np.ndarray:
    """Source-side ids: a token never seen on the source side is <unk>."""
    return np.where(self._source_known[ids], ids, UNK).astype(np.int32) if self.separate else ids

  def __len__(self) -> int:
    return self.size

  def encode(self, text: str) -> np.ndarray:
    """Token ids of one sentence (no eos)."""
    if self.kind == "spm":
      return np.asarray(self.sp.encode(text), np.int32)
    return np.asarray([self.index.get(t, UNK) for t in text.split()], np.int32)

  def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
    """`encode` of many sentences (sentencepiece encodes the list in one call)."""
    if self.kind == "spm":
      return [np.asarray(x, np.int32) for x in self.sp.encode(list(texts))]
    return [self.encode(t) for t in texts]

  def decode(self, ids) -> str:
    """Detokenised text of ids, stopping at the first eos and dropping pad/bos."""
    out = []
    for i in np.asarray(ids).reshape(-1).tolist():
      if i == EOS:
        break
      if i not in (PAD, BOS):
        out.append(int(i))
    if self.kind == "spm":
      return self.sp.decode(out)
    return remove_bpe(" ".join(self.tokens[i] for i in out))

  def _sides(self) -> dict:
    return {"target_size": self.target_size, "source_unseen": self.source_unseen.tolist()} if self.separate else {}

  def fingerprint(self) -> str:
    blob = self.proto if self.kind == "spm" else json.dumps(self.tokens).encode()
    if self.separate:  # a joint vocabulary's fingerprint is what it was before separate dictionaries
      blob += json.dumps(self._sides()).encode()
    return hashlib.sha256(blob).hexdigest()[:16]

  def save(self, directory: str) -> str:
    """Write the vocabulary file into `directory` (atomically); returns its path."""
    path = os.path.join(directory, self.FILES[self.kind])
    blob = self.proto if self.kind == "spm" else json.dumps({"tokens": self.tokens, **self._sides()}).encode()
    _atomic_bytes(path, blob)
    return path

  @classmethod
  def load(cls, directory: str) -> "SubwordVocab":
    """The vocabulary file saved in `directory` by `save`."""
    spm_path, bpe_path = (os.path.join(directory, f) for f in (cls.FILES["spm"], cls.FILES["bpe"]))
    try:
      if os.path.exists(spm_path):
        with open(spm_path, "rb") as f:
          return cls(spm_proto=f.read())
      if os.path.exists(bpe_path):
        with open(bpe_path, encoding="utf-8") as f:
          held = json.load(f)
        return cls(tokens=held["tokens"], target_size=held.get("target_size", 0),
                   source_unseen=held.get("source_unseen", ()))
    except (RuntimeError, ValueError, KeyError, TypeError, DataError) as e:
      raise DataError(f"damaged vocabulary file in {directory}: {first_line(e)}") from None
    raise DataError(f"no vocabulary in {directory} (expected {' or '.join(cls.FILES.values())})")


def _atomic_bytes(path: str, blob: bytes) -> None:
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "wb") as f:
    f.write(blob)
  os.replace(tmp, path)


def train_sentencepiece(lines, vocab_size: int, model_type: str = "unigram") -> SubwordVocab:
  """A joint sentencepiece model on `lines` (reproducible: one thread, every sentence, no shuffling)."""
  import sentencepiece as spm

  model = io.BytesIO()
  try:
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=int(vocab_size), model_type=model_type,
        character_coverage=1.0, pad_id=PAD, unk_id=UNK, bos_id=BOS, eos_id=EOS, num_threads=1,
        input_sentence_size=0, shuffle_input_sentence=False, hard_vocab_limit=False, minloglevel=2)
  except RuntimeError as e:
    raise DataError(f"sentencepiece training failed: {first_line(e)}") from None
  vocab = SubwordVocab(spm_proto=model.getvalue())
  if vocab.size != int(vocab_size):  # hard_vocab_limit=False: a small text gives fewer pieces than asked
    logging.getLogger(__name__).warning(
        f"sentencepiece: {vocab.size:,} pieces, not the data.vocab_size={int(vocab_size):,} asked for (the "
        "training text has no more; the size is a soft limit)")
  return vocab


@functools.lru_cache(maxsize=None)
def _moses_detokenizer(lang: str):
  try:
    from sacremoses import MosesDetokenizer
  except ImportError:
    raise ConfigError("data.format=fairseq detokenises with sacremoses: pip install 'trime-jax[mt]'") from None
  return MosesDetokenizer(lang)


def moses_detokenize(text: str, lang: str) -> str:
  """`text` (Moses-tokenised, escaped) as fairseq's --tokenizer moses decodes it: MosesDetokenizer(lang)."""
  return _moses_detokenizer(lang).detokenize(text.split())


def text_of(vocab: "SubwordVocab", detokenize_lang: str = ""):
  """line -> the text BLEU compares: a sentencepiece line as it is; a BPE line without `@@ `, then (when
  `detokenize_lang`, the fairseq format) Moses-detokenised."""
  if vocab.kind == "spm":
    return lambda t: t
  if detokenize_lang:
    return lambda t: moses_detokenize(remove_bpe(t), detokenize_lang)
  return remove_bpe


@dataclasses.dataclass
class ParallelData:
  """Sentence pairs as token ids (no eos), with their raw text (targets: the BLEU references)."""

  src: list  # list[np.ndarray int32]
  tgt: list
  src_text: list
  tgt_text: list
  vocab: SubwordVocab
  split: str = ""
  detokenize_lang: str = ""  # the fairseq format: the target language whose Moses tokenisation `text` undoes

  def text(self, ids) -> str:
    """A hypothesis's token ids as the text compared with `tgt_text` (`SubwordVocab.decode`, then the Moses
    detokeniser for the fairseq format)."""
    text = self.vocab.decode(ids)
    return moses_detokenize(text, self.detokenize_lang) if self.detokenize_lang else text

  def __len__(self) -> int:
    return len(self.src)

  def head(self, n: int) -> "ParallelData":
    """The first `n` pairs (all of them when n is 0 or at least their number)."""
    if not n or n >= len(self):
      return self
    return dataclasses.replace(self, src=self.src[:n], tgt=self.tgt[:n], src_text=self.src_text[:n],
                               tgt_text=self.tgt_text[:n])

  def fingerprint(self) -> str:
    """SHA-256 (16 hex digits) of every pair's token ids, in order: what a batch plan and a resumed training
    were made of (the same texts under another vocabulary are other ids, so another fingerprint)."""
    h = hashlib.sha256()
    for src, tgt in zip(self.src, self.tgt):
      for ids in (src, tgt):
        ids = np.asarray(ids, np.int32)
        h.update(len(ids).to_bytes(4, "little") + ids.tobytes())
    return h.hexdigest()[:16]

  def lengths(self) -> tuple[np.ndarray, np.ndarray]:
    """(source, target) lengths in model tokens: ids + eos."""
    return (np.asarray([len(s) + 1 for s in self.src], np.int64), np.asarray([len(t) + 1 for t in self.tgt], np.int64))


def resolve_data_path(config) -> None:
  """A relative data.path is tried from the working directory, then the repository root."""
  p = config.data.path
  if p and not os.path.isabs(p) and not os.path.exists(p):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    alt = os.path.join(root, p)
    if os.path.exists(alt):
      config.data.path = alt


def _paths(config, split: str) -> tuple[str, str]:
  d = config.data
  return (os.path.join(d.path, f"{split}.{d.src_lang}"), os.path.join(d.path, f"{split}.{d.tgt_lang}"))


def read_aligned(src_path: str, tgt_path: str) -> tuple[list[str], list[str]]:
  """Lines of two aligned files; one DataError for a missing, empty, undecodable or misaligned pair."""
  out = []
  for p in (src_path, tgt_path):
    if not os.path.isfile(p):
      raise DataError(f"parallel data file not found: {p}")
    try:
      with open(p, encoding="utf-8") as f:
        lines = f.read().split("\n")
    except UnicodeDecodeError as e:
      raise DataError(f"{p} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    if lines and lines[-1] == "":
      lines.pop()
    if not lines:
      raise DataError(f"parallel data file is empty: {p}")
    out.append([l.rstrip("\r") for l in lines])
  if len(out[0]) != len(out[1]):
    raise DataError(f"misaligned parallel data: {src_path} has {len(out[0])} lines, {tgt_path} has {len(out[1])}")
  return out[0], out[1]


def _text_digest(paths) -> str:
  h = hashlib.sha256()
  for p in paths:
    with open(p, "rb") as f:
      h.update(hashlib.sha256(f.read()).digest())
  return h.hexdigest()[:16]


def load_vocab(config) -> SubwordVocab:
  """The vocabulary of `config.data` (trained on / built from the training split; cached): a joint one, or
  (fairseq format, data.dictionaries="separate") one dictionary per side in one id space."""
  d = config.data
  fmt = d.get("format", "text")
  if fmt not in FORMATS:
    raise ConfigError(f"data.format must be one of {FORMATS}, got {fmt!r}")
  src_path, tgt_path = _paths(config, "train")
  src, tgt = read_aligned(src_path, tgt_path)
  if fmt == "fairseq":
    def by_count(lines):  # most frequent first, ties by token (fairseq's Dictionary.finalize)
      counts = collections.Counter(t for line in lines for t in line.split())
      for s in SPECIALS:
        counts.pop(s, None)
      return [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]

    dictionaries = str(d.get("dictionaries", "joint"))
    if dictionaries not in DICTIONARIES:
      raise ConfigError(f"data.dictionaries must be one of {DICTIONARIES}, got {dictionaries!r}")
    if dictionaries == "joint":
      return SubwordVocab(tokens=list(SPECIALS) + by_count(src + tgt))
    # fairseq's preprocess without --joined-dictionary: the target side's own dictionary, padded to a multiple of
    # 8 with madeupword tokens as fairseq pads it (real, if never target, entries of the original's softmax), then
    # the source-only tokens, so one id space holds both
    target = list(SPECIALS) + by_count(tgt)
    target += [f"madeupword{i:04d}" for i in range(-len(target) % 8)]
    seen = set(target)
    source = by_count(src)
    source_seen = set(source)
    tokens = target + [t for t in source if t not in seen]
    unseen = [i for i, t in enumerate(target) if i >= len(SPECIALS) and t not in source_seen]
    return SubwordVocab(tokens=tokens, target_size=len(target), source_unseen=unseen)
  model_type = d.get("spm_model_type", "unigram")
  key = f"{_text_digest([src_path, tgt_path])}-{d.vocab_size}-{model_type}"
  cache = os.path.join(d.cache_dir, f"spm-{key}") if d.get("cache_dir") else None
  if cache and os.path.exists(os.path.join(cache, SubwordVocab.FILES["spm"])):
    return SubwordVocab.load(cache)
  vocab = train_sentencepiece(src + tgt, d.vocab_size, model_type)
  if cache:
    os.makedirs(cache, exist_ok=True)
    vocab.save(cache)
  return vocab


def remove_bpe(text: str) -> str:
  """`text` without subword-nmt's `@@ ` continuations (fairseq's --remove-bpe)."""
  return (text + " ").replace("@@ ", "").rstrip()


def load_parallel(config, split: str, vocab: SubwordVocab | None = None) -> ParallelData:
  """Sentence pairs of `split` (train | valid | test), each side encoded with its dictionary (`SubwordVocab`).

  Training pairs with an empty side or longer than data.max_len model tokens (ids + eos) are dropped, as
  fairseq filters its training set by max positions; valid/test keep every pair (their references stay whole)
  and are truncated to data.max_len tokens."""
  if split not in SPLITS:
    raise ConfigError(f"split must be one of {SPLITS}, got {split!r}")
  vocab = vocab or load_vocab(config)
  src_text, tgt_text = read_aligned(*_paths(config, split))
  max_len = int(config.data.get("max_len", 0) or 0)
  fairseq = str(config.data.get("format", "text")) == "fairseq"
  src, tgt, keep, cut, refs = [], [], [], 0, []
  for i, (x, y) in enumerate(zip(vocab.encode_batch(src_text), vocab.encode_batch(tgt_text))):
    x, y = vocab.encode_source(x), vocab.encode_target(y)  # each side's own dictionary (separate ones)
    if split == "train" and (not len(x) or not len(y) or (max_len and max(len(x), len(y)) + 1 > max_len)):
      continue
    if fairseq:  # the original's reference is its ids' string: a token outside the dictionary as `<<unk>>`
      # (`tgt_dict.string(..., escape_unk=True)`), before BPE removal; a hypothesis's own <unk> stays `<unk>`
      refs.append(" ".join("<<unk>>" if j == UNK else t for t, j in zip(tgt_text[i].split(), y.tolist())))
    if max_len:
      cut += len(x) > max_len - 1 or len(y) > max_len - 1
      x, y = x[:max_len - 1], y[:max_len - 1]
    src.append(x)
    tgt.append(y)
    keep.append(i)
  if not src:
    raise DataError(f"no usable sentence pairs in {split} of {config.data.path} (all empty or longer than "
                    f"data.max_len={max_len})")
  if cut:  # said: a translation of a cut source is scored against the whole reference
    logging.getLogger(__name__).warning(
        f"{split}: {cut:,} of {len(src):,} pairs are longer than data.max_len={max_len} model tokens and were cut "
        f"to {max_len - 1} tokens (the model's positions); BLEU still compares with the whole references")
  # BPE'd lines (fairseq format) are the texts without their `@@ ` continuations and Moses's tokenisation, as
  # hypotheses are decoded (`ParallelData.text`): the BLEU references
  src_lang, tgt_lang = (config.data.src_lang, config.data.tgt_lang) if fairseq else ("", "")
  src_line, tgt_line = text_of(vocab, src_lang), text_of(vocab, tgt_lang)
  references = refs if fairseq else [tgt_text[i] for i in keep]
  return ParallelData(src, tgt, [src_line(src_text[i]) for i in keep], [tgt_line(r) for r in references], vocab,
                      split, tgt_lang)


def collate(src_list, tgt_list, src_len: int, tgt_len: int, rows: int | None = None) -> dict:
  """Right-padded batch arrays of pairs (ids without eos):

    src [R, S] = x + [eos], pad 0;  prev [R, T] = [eos] + y, pad 0;  targets [R, T] = y + [eos], pad -1.
  `rows` (>= len) pads the batch with empty rows (all padding: no loss, never memory). Sequences longer than
  the shapes are an error (the batcher picks shapes that fit)."""
  n = len(src_list)
  rows = n if rows is None else rows
  src = np.zeros((rows, src_len), np.int32)
  prev = np.zeros((rows, tgt_len), np.int32)
  targets = np.full((rows, tgt_len), -1, np.int32)
  for r, (x, y) in enumerate(zip(src_list, tgt_list)):
    if len(x) + 1 > src_len or len(y) + 1 > tgt_len:
      raise ValueError(f"pair of lengths ({len(x)}, {len(y)}) does not fit shapes ({src_len}, {tgt_len})")
    src[r, :len(x)] = x
    src[r, len(x)] = EOS
    prev[r, 0] = EOS
    prev[r, 1:len(y) + 1] = y
    targets[r, :len(y)] = y
    targets[r, len(y)] = EOS
  return {"src": src, "prev": prev, "targets": targets}


def pack(src_list, tgt_list, row_len: int, rows_multiple: int = 8) -> dict:
  """The pairs packed several to a row (first-fit, longest first): the arrays of `collate` at [R, row_len] plus

    src_seg / tgt_seg [R, row_len]: the pair's number (1, 2, ...; 0 = padding) at each source / target position
    src_pos / tgt_pos [R, row_len]: the position within the pair's own sequence (0, 1, ...)

  A pair's source and target share one row (cross-attention stays in the row); R is rounded up to a multiple
  of `rows_multiple` (few shapes, few compilations). The model masks attention to the own pair and restarts
  positions (`TransformerMT` segments); the loss treats pair numbers as rows (`loss.batch_meta(rows_BxL=)`), so a
  packed batch computes what `collate` of the same pairs does, without most of its padding."""
  need = [max(len(x), len(y)) + 1 for x, y in zip(src_list, tgt_list)]
  if need and max(need) > row_len:
    raise ValueError(f"a pair of {max(need)} tokens does not fit packed rows of {row_len}")
  fill_src, fill_tgt, where = [], [], {}
  for i in sorted(range(len(need)), key=lambda i: (-need[i], i)):
    ls, lt = len(src_list[i]) + 1, len(tgt_list[i]) + 1
    for r in range(len(fill_src)):
      if fill_src[r] + ls <= row_len and fill_tgt[r] + lt <= row_len:
        break
    else:
      r = len(fill_src)
      fill_src.append(0)
      fill_tgt.append(0)
    where[i] = (r, fill_src[r], fill_tgt[r])
    fill_src[r] += ls
    fill_tgt[r] += lt
  rows = max(rows_multiple, -(-len(fill_src) // rows_multiple) * rows_multiple)
  z = lambda fill=0: np.full((rows, row_len), fill, np.int32)
  out = {"src": z(), "prev": z(), "targets": z(-1), "src_seg": z(), "tgt_seg": z(), "src_pos": z(), "tgt_pos": z()}
  for i, (r, a, b) in where.items():
    x, y = src_list[i], tgt_list[i]
    out["src"][r, a:a + len(x)] = x
    out["src"][r, a + len(x)] = EOS
    out["prev"][r, b] = EOS
    out["prev"][r, b + 1:b + len(y) + 1] = y
    out["targets"][r, b:b + len(y)] = y
    out["targets"][r, b + len(y)] = EOS
    out["src_seg"][r, a:a + len(x) + 1] = i + 1
    out["tgt_seg"][r, b:b + len(y) + 1] = i + 1
    out["src_pos"][r, a:a + len(x) + 1] = np.arange(len(x) + 1)
    out["tgt_pos"][r, b:b + len(y) + 1] = np.arange(len(y) + 1)
  return out

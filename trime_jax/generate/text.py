"""Text <-> token ids for generation: bytes of UTF-8, or WikiText-style words with `</s>` at line ends."""

from __future__ import annotations

from typing import Callable

from trime_jax import data
from trime_jax.errors import ConfigError


class Text:
  """The export's vocabulary read and written as text; `log` hears about words outside the vocabulary."""

  def __init__(self, vocab: data.Vocab, log: Callable[[str], None]):
    self.vocab, self.log = vocab, log

  def tokenize(self, text: str, what: str = "prompt", unknown: set | None = None) -> list[int]:
    """Token ids of `text`: bytes of its UTF-8, or WikiText-style words with `</s>` at each line end (the
    last line's only if the text ends with a newline). Unknown words map to <unk>, with one warning; or, given
    `unknown`, are added to it (one warning for many texts: `warn_unknown`)."""
    if self.vocab.kind == "bytes":
      try:
        return list(text.encode("utf-8"))
      except UnicodeEncodeError as e:  # a lone surrogate (e.g. from os.fsdecode of bad bytes): no UTF-8 for it
        raise ConfigError(f"the {what} has no UTF-8 form: character {e.start} ({text[e.start:e.end]!r}) "
                          f"{e.reason}") from None
    lines = text.split("\n")
    words = []
    for i, line in enumerate(lines):
      words += line.split()
      if i < len(lines) - 1:
        words.append(data.EOS)
    ids = self.vocab.encode_words(words)
    found = {w for w, i in zip(words, ids) if i == self.vocab.unk and w != data.UNK}
    if unknown is not None:
      unknown |= found
    else:
      self.warn_unknown(found, f"the {what}")
    return ids

  def warn_unknown(self, unknown: set, where: str) -> None:
    """One warning naming the words of `where` outside the vocabulary (nothing if there are none)."""
    if unknown:
      shown = ", ".join(sorted(unknown)[:8]) + (", ..." if len(unknown) > 8 else "")
      self.log(f"warning: {len(unknown)} word(s) of {where} are not in the model's vocabulary and read as "
               f"{data.UNK}: {shown}")

  def detokenize(self, ids) -> str:
    if self.vocab.kind == "bytes":
      return bytes(int(i) for i in ids).decode("utf-8", errors="replace")
    words = ["\n" if self.vocab.tokens[i] == data.EOS else self.vocab.tokens[i] for i in ids]
    return " ".join(words).replace(" \n ", "\n").replace(" \n", "\n").replace("\n ", "\n")

  def continuation(self, prompt: str, ids) -> str:
    """The text of `ids` generated after `prompt`, such that `prompt + continuation` reads as one text: a word
    model's first word is set apart from the prompt's last by a space (unless the prompt ends in whitespace or
    the continuation starts a new line); bytes are the bytes as they come."""
    text = self.detokenize(ids)
    if self.vocab.kind == "words" and text and prompt and not prompt[-1].isspace() and not text.startswith("\n"):
      return " " + text
    return text

  def token_str(self, i: int) -> str:
    """One token, readable on one line."""
    return self.detokenize([i]).replace("\n", "⏎") if self.vocab.kind == "bytes" else self.vocab.tokens[i]

  def context(self, stream, end: int, words: int) -> str:
    """About `words` words (3x as many bytes) of `stream` before position `end`, readable on one line."""
    n = words * (3 if self.vocab.kind == "bytes" else 1)
    text = self.detokenize(stream[max(0, end - n):end])
    return "..." + text.replace("\n", "⏎") + (" " if self.vocab.kind == "words" else "")

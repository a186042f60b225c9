"""Corpus BLEU with sacrebleu (its default 13a tokenisation, exact-match, no lower-casing) on detokenised text:
hypotheses are `SubwordVocab.decode`d model outputs, references the target lines as `mt.data.load_parallel`
reads them (raw text; fairseq-format lines without their `@@ ` BPE continuations)."""

from __future__ import annotations

from trime_jax.errors import ConfigError


def corpus_bleu(hypotheses: list[str], references: list[str]) -> dict:
  """{bleu, signature, precisions, bp, sys_len, ref_len} of detokenised hypotheses against one reference each."""
  import sacrebleu

  if len(hypotheses) != len(references):
    raise ConfigError(f"{len(hypotheses)} hypotheses for {len(references)} references")
  metric = sacrebleu.metrics.BLEU()
  score = metric.corpus_score(list(hypotheses), [list(references)])
  return {"bleu": float(score.score), "signature": str(metric.get_signature()),
          "precisions": [float(p) for p in score.precisions], "bp": float(score.bp), "sys_len": int(score.sys_len),
          "ref_len": int(score.ref_len)}

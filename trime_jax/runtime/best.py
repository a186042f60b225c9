"""`train.keep_best`: the parameters with the lowest dev perplexity so far, exported beside the final ones."""

from __future__ import annotations

import math
import os
import json

import jax
import numpy as np
from absl import logging

from trime_jax import checkpoint as ckpt


class BestKeeper:
  """Exports the parameters with the lowest dev perplexity so far to `directory` (same layout as
  `<workdir>/export`, meta.json adds step, best_metric and dev_ppl). The best so far is read back from
  meta.json, so a resumed run keeps comparing against it; runs are deterministic, so a best written past
  the resumed checkpoint is the state the resumed run reaches again."""

  def __init__(self, directory: str, enabled: bool, metric: str, config, vocab, extra: dict):
    self.directory, self.enabled, self.metric = directory, enabled, metric
    self.config, self.vocab, self.extra = config, vocab, extra
    self.ppl = math.inf
    meta = os.path.join(directory, "meta.json")
    if enabled and os.path.exists(meta):
      with open(meta) as f:
        self.ppl = float(json.load(f).get("dev_ppl", math.inf))

  def update(self, step: int, params, dev: dict) -> None:
    ppl = dev.get(self.metric, math.nan)
    if not (self.enabled and ppl < self.ppl):  # NaN never wins
      return
    ckpt.export(self.directory, host_copy(params), self.config, self.vocab,
                extra={**self.extra, "step": step, "best_metric": self.metric, "dev_ppl": ppl})
    self.ppl = ppl
    logging.info("best dev %s %.4f at update %d: exported to %s", self.metric, ppl, step, self.directory)


def host_copy(tree):
  """NumPy copy of replicated arrays on this host (works when they span several processes)."""
  return jax.tree_util.tree_map(
      lambda x: np.asarray(x.addressable_data(0)) if isinstance(x, jax.Array) else np.asarray(x), tree)

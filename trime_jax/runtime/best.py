"""`train.keep_best`: the parameters with the lowest dev perplexity so far, exported beside the final ones."""

from __future__ import annotations

import math
import os
import json

import jax
import numpy as np
from absl import logging



class BestKeeper:
  """Exports the parameters with the lowest dev perplexity so far to `directory` with the task's `export(directory,
  params, extra)` (the layout of `<workdir>/export`; meta.json adds step, best_metric and dev_ppl). The best so
  far is read back from meta.json, so a resumed run keeps comparing against it; runs are deterministic, so a best
  written past the resumed checkpoint is the state the resumed run reaches again."""

  def __init__(self, directory: str, enabled: bool, metric: str, export):
    self.directory, self.enabled, self.metric, self.export = directory, enabled, metric, export
    self.ppl = math.inf
    meta = os.path.join(directory, "meta.json")
    if enabled and os.path.exists(meta):
      with open(meta) as f:
        self.ppl = float(json.load(f).get("dev_ppl", math.inf))

  def update(self, step: int, params, dev: dict) -> None:
    ppl = dev.get(self.metric, math.nan)
    if not (self.enabled and ppl < self.ppl):  # NaN never wins
      return
    self.export(self.directory, host_copy(params), {"step": step, "best_metric": self.metric, "dev_ppl": ppl})
    self.ppl = ppl
    logging.info("best dev %s %.4f at update %d: exported to %s", self.metric, ppl, step, self.directory)


def host_copy(tree):
  """NumPy copy of replicated arrays on this host (works when they span several processes)."""
  return jax.tree_util.tree_map(
      lambda x: np.asarray(x.addressable_data(0)) if isinstance(x, jax.Array) else np.asarray(x), tree)

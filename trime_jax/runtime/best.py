"""`train.keep_best`: the parameters with the lowest dev perplexity (or the highest of a metric to maximise, a
translation's valid BLEU) so far, exported beside the final ones."""

from __future__ import annotations

import math
import os

import jax
import numpy as np
from absl import logging

from trime_jax import data
from trime_jax.distributed import on_chief
from trime_jax.errors import DamagedCheckpointError



class BestKeeper:
  """Exports the parameters with the lowest dev perplexity so far to `directory` with the task's `export(directory,
  params, extra)` (the layout of `<workdir>/export`; meta.json adds step, best_metric and dev_ppl). The best so
  far is read back from meta.json, so a resumed run keeps comparing against it; runs are deterministic, so a best
  written past the resumed checkpoint is the state the resumed run reaches again."""

  def __init__(self, directory: str, enabled: bool, metric: str, export, *, protocol: dict | None = None,
               remeasure=None, split: str = "dev", maximize: bool = False):
    """`protocol`: the settings the dev perplexity depends on (how much of dev, which windows), recorded beside
    the best. A resumed run may change them (they do not change training), and a best measured otherwise does
    not compare: `remeasure(directory)` (the task's dev evaluation of the exported best parameters) measures it
    again under this run's protocol, said in one line."""
    self.directory, self.enabled, self.metric, self.export = directory, enabled, metric, export
    # maximize: a metric that is better higher (translation's valid BLEU); meta.json's `dev_ppl` then holds it too
    self.sign = -1.0 if maximize else 1.0
    self.split = split  # the task's name of its dev split in log lines ("valid" for translation)
    self.protocol = dict(protocol or {})
    self.ppl = math.inf
    self.step = None  # the update of the best so far (a rerun's equal value at that update is not a new best)
    meta = os.path.join(directory, "meta.json")
    if enabled:  # a best being replaced when a run was killed: it is still the best so far (process 0 puts it
      # back; the others read it after)
      on_chief(lambda: data.recover_replaced(directory))
    if enabled and os.path.exists(meta):
      stored = data.read_json(meta, "best-by-dev export meta", DamagedCheckpointError,
                              fix=f"restore it, or remove {directory} (its best so far is then forgotten)")
      value = float(stored.get("dev_ppl", math.inf))
      before = stored.get("dev_protocol")
      other_metric = stored.get("best_metric", metric) != metric  # ranked by another metric: not comparable
      other_protocol = before is not None and self.protocol and before != self.protocol
      if other_metric and remeasure is None:
        value = math.nan
      elif (other_metric or other_protocol) and remeasure is not None:  # measured again, once
        again = float(remeasure(directory).get(metric, math.nan))
        logging.info("best %s %s of update %s was measured with %s (%s); with this run's %s (%s) it is %.4f",
                     split, stored.get("best_metric", metric), stored.get("step"), before, value, metric,
                     self.protocol, again)
        value = again
      self.ppl = self.sign * value if math.isfinite(value) else math.inf
      self.step = stored.get("step") if math.isfinite(value) else None

  def update(self, step: int, params, dev: dict) -> None:
    """A tie goes to the later update, as the original's checkpoint_best.pt (fairseq's checkpoint_utils
    is_better: a <= b, or a >= b for a metric to maximise; an early translation run's valid BLEU ties at 0)."""
    value = dev.get(self.metric, math.nan)
    # NaN and inf never win; a tie at the best's own update (a rerun of a finished run measuring it again) is not
    # a new best, a better value there is (a resumed run whose evaluation changed)
    if not (self.enabled and math.isfinite(value)):
      return
    if not (self.sign * value < self.ppl or (self.sign * value == self.ppl and step != self.step)):
      return
    self.export(self.directory, host_copy(params), {"step": step, "best_metric": self.metric, "dev_ppl": value,
                                                    "dev_protocol": self.protocol})
    self.ppl, self.step = self.sign * value, step
    logging.info("best %s %s %.4f at update %d: exported to %s", self.split, self.metric, value, step, self.directory)


def host_copy(tree):
  """NumPy copy of replicated arrays on this host (works when they span several processes)."""
  return jax.tree_util.tree_map(
      lambda x: np.asarray(x.addressable_data(0)) if isinstance(x, jax.Array) else np.asarray(x), tree)

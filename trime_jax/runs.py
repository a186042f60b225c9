"""Glue that CLIs and notebooks share: evaluate an exported checkpoint on a config's data, sweep the long-term
memory size, summarise and plot a sweep."""

from __future__ import annotations

import re

from trime_jax import checkpoint as ckpt
from trime_jax import corpora
from trime_jax import evaluate as E
from trime_jax.errors import CheckpointError


def load_eval_data(config, vocab):
  """The config's corpora encoded with the checkpoint's vocabulary (kinds must agree)."""
  splits = corpora.load_splits(config.data, vocab=vocab if vocab.kind == "words" else None)
  if splits.vocab.kind != vocab.kind or len(splits.vocab) != len(vocab):
    raise CheckpointError(
        f"checkpoint vocabulary ({vocab.kind}, {len(vocab)} tokens) does not match data.corpus="
        f"{config.data.corpus!r} ({splits.vocab.kind}, {len(splits.vocab)} tokens)")
  return splits


def evaluate_checkpoint(config, checkpoint_dir: str, *, progress: bool = False, mem_sizes=None,
                        label: str = "") -> list[dict]:
  """Rows (one per variant and memory size) of perplexity on `config.eval.split`.

  `mem_sizes` sweeps the long-term memory size (default: just `eval.mem_size`); the checkpoint and data are
  loaded once. With `eval.tune`, the best variant of each memory size is marked. Every row carries `family`
  (none | trime | cache), `mem_size`, `split` and, if given, the model `label`.
  """
  graphdef, params, train_config, vocab, meta = ckpt.load_export(checkpoint_dir)
  splits = load_eval_data(config, vocab)
  e = config.eval
  if e.block_len > train_config.model.max_len:
    raise CheckpointError(f"eval.block_len={e.block_len} exceeds the checkpoint's model.max_len="
                          f"{train_config.model.max_len}")
  sizes = [int(m) for m in mem_sizes] if mem_sizes else [int(e.mem_size)]
  if e.memory == "none":
    sizes = [0]  # nothing reads the store
  rows = []
  for mem in sizes:
    variants = E.variants_from_config(e, mem_size=mem)
    results = E.evaluate(graphdef, params, splits.get(e.split), block_len=e.block_len,
                         context_window=e.context_window, batch_size=e.batch_size, variants=variants,
                         vocab_chunk=train_config.train.vocab_chunk, max_tokens=e.max_tokens, progress=progress)
    block = [{**r.as_dict(), "family": f, "mem_size": mem, "split": e.split, **({"model": label} if label else {})}
             for r, f in zip(results, variants.families())]
    if e.tune and len(block) > 2:
      best = min(block[1:], key=lambda r: r["nll"])
      best["variant"] += "  <- best"
    rows += block
  return rows


FAMILY_NAMES = {"none": "none", "trime": "TRIME (local + long-term)", "cache": "continuous cache"}


def sweep_best(rows: list[dict]) -> dict:
  """{(model, family): {mem_size: best row}}: the lowest nll per memory size (τ or λ, θ tuned on the rows'
  split); the vanilla softmax ("none") is taken once per model, at memory size 0."""
  best = {}
  for r in rows:
    fam = r.get("family", "none")
    if fam == "none" and r.get("mem_size", 0):
      continue
    cell = best.setdefault((r.get("model", ""), fam), {})
    mem = r.get("mem_size", 0)
    if mem not in cell or r["nll"] < cell[mem]["nll"]:
      cell[mem] = r
  return best


def _params(variant: str) -> str:
  """'local+long(tau=1.25,mem=4096)  <- best' -> 'tau=1.25'."""
  m = re.search(r"\((.*)\)", variant)
  return ",".join(p for p in (m.group(1).split(",") if m else []) if not p.startswith("mem="))


def sweep_table(rows: list[dict]) -> str:
  """Markdown: one line per (model, memory family), one column per memory size; cells are the best
  perplexity (bits per byte for byte corpora) with the tuned parameters."""
  best = sweep_best(rows)
  sizes = sorted({m for cells in best.values() for m in cells})
  metric = "bpc" if any("bpc" in r for r in rows) else "ppl"
  head = f"| model | test memory ({metric}) | " + " | ".join(f"{m:,}" for m in sizes) + " |"
  lines = [head, "|" + "---|" * (len(sizes) + 2)]
  for (model, fam), cells in best.items():
    vals = []
    for m in sizes:
      r = cells.get(m)
      vals.append("" if r is None else f"{r[metric]:.3f}" + (f" ({_params(r['variant'])})" if fam != "none" else ""))
    lines.append(f"| {model} | {FAMILY_NAMES.get(fam, fam)} | " + " | ".join(vals) + " |")
  return "\n".join(lines)


def plot_sweep(rows: list[dict], path: str, title: str = "") -> str:
  """PNG of the best perplexity (or bpc) against the long-term memory size, one line per (model, memory
  family); the plain softmax as a dotted level per model. Needs matplotlib."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  best = sweep_best(rows)
  metric = "bpc" if any("bpc" in r for r in rows) else "ppl"
  sizes = sorted({m for cells in best.values() for m in cells})
  x = {m: i for i, m in enumerate(sizes)}  # memory sizes roughly double: even spacing reads best
  models = list(dict.fromkeys(model for model, _ in best))
  style = {"trime": dict(ls="-", marker="o"), "cache": dict(ls="-.", marker="s")}
  fig, ax = plt.subplots(figsize=(6.4, 4.2))
  for (model, fam), cells in best.items():
    color = f"C{models.index(model) % 10}"  # one colour per model, one line style per memory family
    prefix = f"{model}: " if model else ""
    if fam == "none":
      ax.axhline(cells[0][metric], ls=":", lw=1, color=color, label=f"{prefix}no memory")
      continue
    ms = sorted(cells)
    ax.plot([x[m] for m in ms], [cells[m][metric] for m in ms], color=color, label=prefix + FAMILY_NAMES[fam],
            **style.get(fam, {}))
  ax.set_xticks(range(len(sizes)), [f"{m:,}" for m in sizes])
  ax.set_xlabel("long-term memory size (tokens before the window; 0 = local memory only)")
  ax.set_ylabel("perplexity" if metric == "ppl" else "bits per byte")
  ax.set_title(title or f"{rows[0].get('split', '')} {metric} vs long-term memory size")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path

"""Memory-size sweeps (`trime_jax.launch.eval --mem_sizes`): the best point per memory size, as a table and a plot."""

from __future__ import annotations

from trime_jax import evaluate

FAMILY_NAMES = {"none": "none", "trime_local": "TRIME (local + long-term)", "cache": "continuous cache",
                "trime": "TRIME (local + long-term + external)", "interp": "TRIME + interpolation",
                "knnlm": "kNN-LM", "knnlm_cache": "kNN-LM + continuous cache"}


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
    if mem not in cell or evaluate.nll_improves(float(r["nll"]), float(cell[mem]["nll"])):  # NaN never wins
      cell[mem] = r
  return best


# Rows written before evaluate.Point's fields were named as the eval config's (cache_lambda, cache_theta,
# knn_lambda, knn_theta) carry the family-generic keys lam and theta in `params`: --include files still read.
_OLD_DISPLAY_NAMES = {"lam": "lambda", "theta": "theta"}


def _params_text(row: dict) -> str:
  """The tuned parameters of a row, e.g. 'tau=1.25' (rows carry them typed: `params`)."""
  fmt = lambda v: v if isinstance(v, str) else f"{v:g}"
  names = {**_OLD_DISPLAY_NAMES, **evaluate.DISPLAY_NAMES}
  return ",".join(f"{names[k]}={fmt(v)}" for k, v in row.get("params", {}).items())


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
      vals.append("" if r is None else f"{r[metric]:.3f}" + (f" ({_params_text(r)})" if fam != "none" else ""))
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
    ax.plot([x[m] for m in ms], [cells[m][metric] for m in ms], color=color, label=prefix + FAMILY_NAMES.get(fam, fam),
            **style.get(fam, {}))
  ax.set_xticks(range(len(sizes)), [f"{m:,}" for m in sizes])
  ax.set_xlabel(evaluate.mem_size_axis_label(rows))
  ax.set_ylabel("perplexity" if metric == "ppl" else "bits per byte")
  ax.set_title(title or f"{rows[0].get('split', '')} {metric} vs long-term memory size")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path

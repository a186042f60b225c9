"""Memory-size sweeps (`trime_jax.launch.eval --mem_sizes`): the best point per memory size, as a table and a plot."""

from __future__ import annotations

import os

from trime_jax import evaluate
from trime_jax.errors import ConfigError

FAMILY_NAMES = {"none": "none", "trime_local": "TRIME (local + long-term)", "cache": "continuous cache",
                "trime": "TRIME (local + long-term + external)", "interp": "TRIME + interpolation",
                "knnlm": "kNN-LM", "knnlm_cache": "kNN-LM + continuous cache"}


# What sets a row's series apart besides its model and memory family: rows of another split, store layout or
# document setting (rows merged with --include) are other measurements, never candidates for the same cell; so are
# rows of other windows or of another export (rows written before they recorded these fields join any series).
_SERIES_FIELDS = ("split", "long_term_layout", "reset_at_documents")
_SETTING_FIELDS = ("block_len", "context_window", "sample_break_mode", "checkpoint_fingerprint")
_SERIES_TEXT = {"long_term_layout": lambda v: f"{v} layout",
                "reset_at_documents": lambda v: "store per document" if v else "store across documents",
                "block_len": lambda v: f"block {v}", "context_window": lambda v: f"context {v}",
                "sample_break_mode": lambda v: f"{v} blocks",
                # exports.fingerprint: vocabulary-parameters[-architecture]; the parameters' digest tells them apart
                "checkpoint_fingerprint": lambda v: f"export {(str(v).split('-') + [''])[1][:8] or str(v)[:8]}"}


def _group(row: dict) -> str:
  """The row's memory family; interpolation's two P′ memories are two families (as evaluate.Point.group)."""
  fam = row.get("family", "none")
  return f"interp[{row['interp_memory']}]" if fam == "interp" and row.get("interp_memory") else fam


NO_LABEL = "(no --label)"  # the table's model column for rows evaluated without a label (not an empty cell)


def _series_names(rows: list[dict]) -> list[str]:
  """Each row's series: its model, with the _SERIES_FIELDS values that differ among `rows`, and the
  _SETTING_FIELDS values that differ among the rows of its model (models differ in exports: not tagged for
  that), in brackets."""
  varying = [f for f in _SERIES_FIELDS if len({r.get(f) for r in rows}) > 1]
  of_model = {}
  for r in rows:
    of_model.setdefault(r.get("model"), []).append(r)
  settings = {m: [f for f in _SETTING_FIELDS if len({r[f] for r in rs if r.get(f) is not None}) > 1]
              for m, rs in of_model.items()}
  names = []
  for r in rows:
    tags = [_SERIES_TEXT.get(f, str)(r.get(f)) for f in varying + settings[r.get("model")] if r.get(f) is not None]
    names.append((r.get("model") or NO_LABEL) + (f" [{', '.join(tags)}]" if tags else ""))
  return names


def _choose(cands: list[dict], where: str) -> dict:
  """The row of a cell among several: on dev the lowest nll (τ or λ, θ tuned on dev); on another split the lowest
  dev perplexity where every row has it (eval.tune's rows), never the split's own numbers (that would tune on
  test: it did, e.g. between --include files of two τ); rows of one point measured again (a file included twice)
  the first; otherwise ConfigError."""
  if len(cands) == 1:
    return cands[0]
  # (rows that do not name their split, written before rows did, as before: by nll)
  key = "nll" if all(r.get("split", "dev") == "dev" for r in cands) else "dev_ppl" if all(
      "dev_ppl" in r for r in cands) else None
  if key is None:
    points = {r.get("variant") or repr(sorted(r.get("params", {}).items())) for r in cands}
    if len(points) == 1:
      return cands[0]
    splits = sorted({str(r.get("split")) for r in cands})
    raise ConfigError(f"the sweep table's cell {where} has {len(cands)} rows of split {'/'.join(splits)} at "
                      f"different settings ({', '.join(sorted(points))}) and no dev perplexity to choose between "
                      f"them (choosing by {'/'.join(splits)} perplexity would tune on it): tune on dev "
                      "(--config.eval.tune=True), or give each evaluation its own --label")
  best = cands[0]
  for r in cands[1:]:
    if evaluate.nll_improves(float(r[key]), float(best[key])):  # NaN never wins
      best = r
  return best


def sweep_best(rows: list[dict]) -> dict:
  """{(series, family): {mem_size: best row}}: per memory size the row `_choose` picks (τ or λ, θ tuned on dev);
  the vanilla softmax ("none") is taken once per series, at its smallest memory size (it does not read the
  store). A series is a model, told apart by split, store layout, document setting, windows and export where
  the rows hold more than one (_series_names)."""
  cands = {}
  for r, series in zip(rows, _series_names(rows)):
    cands.setdefault((series, _group(r)), {}).setdefault(r.get("mem_size", 0), []).append(r)
  best = {}
  for (series, fam), cells in cands.items():
    if fam == "none":
      cells = {min(cells): cells[min(cells)]}
    best[(series, fam)] = {m: _choose(c, f"({series}, {_family_name(fam)}, memory size {m:,})")
                           for m, c in sorted(cells.items())}
  return best


def _family_name(group: str) -> str:
  if group.startswith("interp["):
    return f"{FAMILY_NAMES['interp']} (P′ over {group[len('interp['):-1]})"
  return FAMILY_NAMES.get(group, group)


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
      # the model alone does not read the store: its one value in every column (the plot's horizontal line)
      r = cells.get(m) if fam != "none" else next(iter(cells.values()))
      vals.append("" if r is None else f"{r[metric]:.3f}" + (f" ({_params_text(r)})" if fam != "none" else ""))
    lines.append(f"| {model} | {_family_name(fam)} | " + " | ".join(vals) + " |")
  return "\n".join(lines)


# What a plot of ours says it is (its metadata's Creator, in formats whose metadata matplotlib writes as text): a
# rerun replaces its own plot, never another image a mistyped name points at (unless --overwrite).
PLOT_CREATOR = "trime-jax memory-size sweep: trime_jax.launch.eval --plot"  # no parentheses (PDF escapes them)
MARKED_FORMATS = ("png", "pdf", "svg", "ps", "eps")


def check_plot_path(path: str, flag: str = "plot", overwrite: bool = False) -> None:
  """ConfigError unless `path` ends in an image format matplotlib writes (.png, .pdf, .svg, ...), or when it is a
  file that is not a plot of ours (`PLOT_CREATOR`) and not `overwrite`: checked before an evaluation, whose plot
  is drawn only at its end."""
  import matplotlib

  matplotlib.use("Agg")
  from matplotlib.figure import Figure

  formats = Figure().canvas.get_supported_filetypes()
  ext = os.path.splitext(path)[1].lstrip(".").lower()
  if ext not in formats:
    said = f"ends in .{ext}" if ext else "has no extension"
    raise ConfigError(f"--{flag}={path} {said}: give an image file name ending in one of "
                      f"{', '.join('.' + f for f in sorted(formats))} (e.g. .png)")
  if ext == "pgf":  # matplotlib writes it through a TeX system: missing, the plot would fail after the evaluation
    import shutil

    tex = matplotlib.rcParams["pgf.texsystem"]
    if not shutil.which(tex):
      raise ConfigError(f"--{flag}={path}: a .pgf plot needs {tex} (LaTeX), which is not installed: give a .png, "
                        ".pdf or .svg name")
  if overwrite or not os.path.isfile(path) or not os.path.getsize(path):
    return
  try:
    with open(path, "rb") as f:
      ours = PLOT_CREATOR.encode() in f.read(1 << 24)
  except OSError:
    return  # unreadable: writing it is refused where it is written, with the reason
  if not ours:
    why = ("exists and is not a plot an earlier evaluation wrote" if ext in MARKED_FORMATS else
           f"exists (a .{ext} image cannot record that a plot of ours wrote it: only .png, .pdf, .svg, .ps and .eps "
           "are replaced without --overwrite)")
    raise ConfigError(f"--{flag}={path} {why} (which would be replaced): it is left as it is; move it away, choose "
                      "another file name, or pass --overwrite")


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
    prefix = f"{model}: " if model and not model.startswith(NO_LABEL) else ""
    if fam == "none":
      ax.axhline(next(iter(cells.values()))[metric], ls=":", lw=1, color=color, label=f"{prefix}no memory")
      continue
    ms = sorted(cells)
    ax.plot([x[m] for m in ms], [cells[m][metric] for m in ms], color=color, label=prefix + _family_name(fam),
            **style.get(fam, {}))
  ax.set_xticks(range(len(sizes)), [f"{m:,}" for m in sizes])
  ax.set_xlabel(evaluate.mem_size_axis_label(rows))
  ax.set_ylabel("perplexity" if metric == "ppl" else "bits per byte")
  ax.set_title(title or f"{rows[0].get('split', '')} {metric} vs long-term memory size")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  # whole or the old one: written beside it, then renamed over it (a kill mid-write left a torn image)
  tmp = f"{path}.tmp{os.getpid()}"
  fmt = os.path.splitext(path)[1].lstrip(".").lower() or "png"
  marked = {"metadata": {"Creator": PLOT_CREATOR}} if fmt in MARKED_FORMATS else {}  # (pgf takes no metadata=)
  fig.savefig(tmp, dpi=120, format=fmt, **marked)
  plt.close(fig)
  os.replace(tmp, path)
  return path

"""The package's layering as docs/architecture.md states it (issue 34), checked on the source with `ast`:

* every module of trime_jax (launch/ and configs/ as trime_jax.launch / trime_jax.configs) sits on a floor;
* no import, top-level or inside a function, points to a higher floor;
* no import circle between modules;
* no module reaches another module's private names (`mod._name`, `from mod import _name`), bench/ included.

A new module fails the first test until it is placed in FLOORS here and in docs/architecture.md's diagram.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
SOURCES = ("trime_jax", "launch", "configs", "bench")

# Longest prefix wins. The same floors as docs/architecture.md's diagram.
FLOORS = {
    # 0: plain utilities (no model, no objective): errors, readers and vocabularies, meshes, files, configs
    "trime_jax.errors": 0, "trime_jax.sharding": 0, "trime_jax.data": 0, "trime_jax.distributed": 0,
    "trime_jax.event_writer": 0, "trime_jax.long_memory": 0, "trime_jax.layers": 0, "trime_jax.flash_attention": 0, "trime_jax.corpora": 0,
    "trime_jax.tfds_builders": 0, "trime_jax.batching": 0, "trime_jax.runtime.lock": 0, "trime_jax.mt.data": 0,
    "trime_jax.mt.bleu": 0, "trime_jax.mt.batching": 0, "trime_jax.configs": 0,
    "trime_jax.mt.decode.beam": 0,  # beam search over a callback: NumPy only (the rest of mt.decode is on 4)
    # 1: the scorer: TRIME's equation and its pieces
    "trime_jax.scoring": 1,
    # 2: objectives (a batch as its own memory) and models (tokens -> vocab stats and keys)
    "trime_jax.loss": 2, "trime_jax.sharded_loss": 2, "trime_jax.steps": 2, "trime_jax.model": 2,
    "trime_jax.srupp": 2, "trime_jax.mt.model": 2,
    # 3: specs from configs, the run's files (checkpoints, exports, workdirs), memory sources (datastores, the
    #    FAISS index, a datastore on the devices), the optimizer
    "trime_jax.specs": 3, "trime_jax.checkpoint": 3, "trime_jax.exports": 3, "trime_jax.runtime": 3, "trime_jax.datastore": 3,
    "trime_jax.knn": 3, "trime_jax.exact_memory": 3, "trime_jax.fairseq_import": 3, "trime_jax.mt.export": 3,
    "trime_jax.mt.decode.retrieval": 3,  # top-K datastore entries for translation: a memory source like knn
    # 4: drivers: training, test time, generation, translation
    "trime_jax.train_config": 4, "trime_jax.train": 4, "trime_jax.evaluate": 4, "trime_jax.generate": 4,
    "trime_jax.mt.train_config": 4, "trime_jax.mt.train": 4, "trime_jax.mt.decode": 4, "trime_jax.mt.datastore": 4,
    # 5: applications: the CLIs, sweeps, the Python API (and the package's lazy top-level names)
    "trime_jax.launch": 5, "trime_jax.sweep": 5, "trime_jax.api": 5, "trime_jax": 5,
    "trime_jax.mt": 4, "trime_jax.pretrained": 5,
}


def _module_name(path: pathlib.Path) -> str:
  parts = list(path.relative_to(REPO).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts = parts[:-1]
  if parts[0] in ("launch", "configs"):
    parts = ["trime_jax", *parts]
  return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
  return {_module_name(p): p for d in SOURCES for p in sorted((REPO / d).rglob("*.py"))}


MODULES = _modules()


def _imports(name: str, path: pathlib.Path):
  """(target module, imported name or None, line) of every import in the file, function-level ones included."""
  is_pkg = path.name == "__init__.py"
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      for a in node.names:
        yield _canonical(a.name), None, node.lineno
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = name.split(".")[:None if is_pkg else -1]
        base = base[:len(base) - (node.level - 1)]
        module = ".".join(base + ([node.module] if node.module else []))
      else:
        module = node.module
      module = _canonical(module)
      for a in node.names:
        sub = f"{module}.{a.name}"
        yield (sub, None, node.lineno) if sub in MODULES else (module, a.name, node.lineno)


def _canonical(module: str) -> str:
  return f"trime_jax.{module}" if module.split(".")[0] in ("launch", "configs") else module


def _floor(module: str):
  best = max((k for k in FLOORS if module == k or module.startswith(k + ".")), key=len, default=None)
  return None if best is None else FLOORS[best]


def _package_edges() -> dict[str, set[str]]:
  return {m: {t for t, _, _ in _imports(m, p) if t in MODULES and t != m}
          for m, p in MODULES.items() if m.startswith("trime_jax")}


def test_every_module_is_on_a_floor():
  unplaced = sorted(m for m in MODULES if m.startswith("trime_jax") and _floor(m) is None)
  assert not unplaced, f"place these in FLOORS (and docs/architecture.md): {unplaced}"


def test_arrows_point_down():
  up = []
  for m, p in MODULES.items():
    if not m.startswith("trime_jax") or _floor(m) is None:
      continue
    for target, _, line in _imports(m, p):
      if target.startswith("trime_jax") and target != m and (_floor(target) or 0) > _floor(m):
        up.append(f"{p.relative_to(REPO)}:{line} {m} (floor {_floor(m)}) -> {target} (floor {_floor(target)})")
  assert not up, "imports pointing up:\n" + "\n".join(up)


def test_the_ground_floors_import_what_the_docs_say():
  edges = _package_edges()
  assert edges["trime_jax.scoring"] == {"trime_jax.sharding"}
  assert edges["trime_jax.loss"] == {"trime_jax.scoring"}
  assert edges["trime_jax.sharded_loss"] <= {"trime_jax.loss", "trime_jax.scoring", "trime_jax.sharding"}


def test_no_import_circle():
  edges = _package_edges()
  index, low, stack, on_stack, cycles = {}, {}, [], set(), []

  def visit(v):  # Tarjan's strongly connected components
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in edges.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        cycles.append(sorted(component))

  for v in sorted(edges):
    if v not in index:
      visit(v)
  # A package's __init__ re-exporting its submodules, which import their siblings (never the package), is no
  # circle; anything else is.
  assert not cycles, f"import circles: {cycles}"


@pytest.mark.parametrize("source", SOURCES)
def test_no_module_reaches_anothers_private_names(source):
  reaches = []
  for m, p in MODULES.items():
    if not p.is_relative_to(REPO / source):
      continue
    tree = ast.parse(p.read_text())
    bound = set()  # local names bound to a module or object of the package (or of bench/)
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        bound |= {a.asname or a.name.split(".")[0] for a in node.names
                  if _canonical(a.name).startswith(("trime_jax", "bench"))}
      elif isinstance(node, ast.ImportFrom):
        module = node.module or ""
        if node.level or _canonical(module).startswith(("trime_jax", "bench")):
          bound |= {a.asname or a.name for a in node.names}
          reaches += [f"{p.relative_to(REPO)}:{node.lineno} from {module} import {a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]
    reaches += [f"{p.relative_to(REPO)}:{node.lineno} {ast.unparse(node)}" for node in ast.walk(tree)
                if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name) and node.value.id in bound]
  assert not reaches, "private names used across modules:\n" + "\n".join(reaches)

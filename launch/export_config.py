"""The config stored in an export (`<workdir>/export/config.json`), over configs/default.py (a config file for
`--config`; it lives here, not in configs/, because it needs an argument).

  python -m launch.eval --checkpoint=runs/mini/export                       # uses this config implicitly
  python -m launch.eval --config=launch/export_config.py:runs/mini/export --config.eval.split=test

Fields the export does not have (added after it was written) keep their defaults; fields this version does not
know are left out.
"""

import json
import os

from configs import default
from trime_jax.errors import CheckpointError


def _update(dst, src: dict) -> None:
  for key, value in src.items():
    if key not in dst:
      continue  # a field this version does not have
    if hasattr(dst[key], "keys") and isinstance(value, dict):
      _update(dst[key], value)
    else:
      dst[key] = tuple(value) if isinstance(dst[key], tuple) and isinstance(value, list) else value


def get_config(export_dir: str = ""):
  path = os.path.join(export_dir, "config.json")
  if not os.path.isfile(path):
    raise CheckpointError(f"no stored config: {path} not found (give --config, or an export directory)")
  with open(path) as f:
    stored = json.load(f)
  c = default.get_config()
  with c.unlocked():
    _update(c, stored)
  return c

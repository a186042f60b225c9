"""bench.dropout_mask at tiny shapes on CPU: both measurements run and print every variant (the numbers are the
bench's to report, not a test's to judge)."""

import contextlib
import io
import re

from bench import dropout_mask


def test_runs_and_reports_every_variant():
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    dropout_mask.main(["--seq=32", "--heads=2", "--head_dim=16", "--step_layers=1", "--repeats=1"])
  text = out.getvalue()
  for variant in ("no dropout", "nnx (threefry)", "hash"):
    assert re.search(rf"^{re.escape(variant)} +\d+\.\d+ +\d+\.\d+ ", text, re.M), (variant, text)
  for mask in ("nnx", "hash"):
    assert re.search(rf"^dropout_mask={mask} +\d+\.\d+ s +XLA plan +\d+\.\d MiB$", text, re.M), (mask, text)
  assert len(re.findall(r"^nnx ÷ hash: \d+\.\d{3}$", text, re.M)) == 2

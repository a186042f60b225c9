"""Reliability (issue 14): the real CLIs on damaged copies of one tiny run, one row per case.

Every error row asserts exit status 2, exactly one `error:` line (no traceback) naming the file or field, and
that no file the user had (the damaged copy, the corpus, the config) was changed. Recovery rows assert the
documented recovery (fall back to the previous checkpoint with the same final parameters, resume a datastore
after a full disk byte for byte, record an allowed config change, no duplicate metrics line).

Speed: the CLIs run in forked children of one driver process (`python -m tests.test_reliability CASES OUT`) that
imports JAX, Flax and orbax once, so a case costs its own work (~0.1 s for a refused load), not ~5 s of imports.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import runpy
import shutil
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------------------------------------
# The driver: runs cases [{module, args, setup}] in forked children; writes OUT/results.json
# ----------------------------------------------------------------------------------------------------------
def _run_forked(module: str, args: list, setup: str, prefix: str) -> int:
  pid = os.fork()
  if pid == 0:  # child: fresh absl flags (the parent never imports launch.*), output to files
    code = 1
    try:
      for fd, ext in ((1, ".out"), (2, ".err")):
        os.dup2(os.open(prefix + ext, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
      if setup:
        exec(setup, {})  # e.g. simulate a full disk by patching os.posix_fallocate
      sys.argv = [module] + list(args)
      runpy.run_module(module, run_name="__main__", alter_sys=True)
      code = 0
    except SystemExit as e:
      code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - a traceback is what the tests look for
      import traceback

      traceback.print_exc()
    finally:
      sys.stdout.flush()
      sys.stderr.flush()
      os._exit(code)
  _, status = os.waitpid(pid, 0)
  return os.waitstatus_to_exitcode(status)


def _driver(cases_path: str, out_dir: str) -> None:
  import flax  # noqa: F401 - imported once, before forking
  import jax  # noqa: F401
  import orbax.checkpoint  # noqa: F401

  import trime_jax.datastore  # noqa: F401
  import trime_jax.evaluate  # noqa: F401
  import trime_jax.train  # noqa: F401

  with open(cases_path) as f:
    cases = json.load(f)
  results = []
  for i, c in enumerate(cases):
    t0 = time.perf_counter()
    prefix = os.path.join(out_dir, f"case{i}")
    rc = _run_forked(c["module"], c["args"], c.get("setup", ""), prefix)
    with open(prefix + ".out") as fo, open(prefix + ".err") as fe:
      results.append({"rc": rc, "out": fo.read(), "err": fe.read(), "seconds": time.perf_counter() - t0})
  with open(os.path.join(out_dir, "results.json"), "w") as f:
    json.dump(results, f)


def run_cases(cases: list, out_dir) -> list:
  """Run CLI cases in one driver subprocess (this module's driver mode); [{rc, out, err, seconds}] in order."""
  from tests.helpers import run_cli_cases
  return run_cli_cases("tests.test_reliability", cases, out_dir, timeout=600)


# ----------------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------------
def tree_hashes(*roots) -> dict:
  """{path: sha256} of every file under `roots` (files or directories)."""
  out = {}
  for root in roots:
    root = str(root)
    paths = [root] if os.path.isfile(root) else glob.glob(os.path.join(root, "**", "*"), recursive=True)
    for p in paths:
      if os.path.isfile(p):
        with open(p, "rb") as f:
          out[p] = hashlib.sha256(f.read()).hexdigest()
  return out


def one_error_line(r) -> str:
  assert r["rc"] == 2, (r["rc"], r["out"][-1500:], r["err"][-3000:])
  assert "Traceback" not in r["err"] and "Event loop is closed" not in r["err"], r["err"][-3000:]
  lines = [ln for ln in r["err"].splitlines() if ln.startswith("error:")]
  assert len(lines) == 1, r["err"][-3000:]
  return lines[0]


def data_files(directory) -> list:
  """Orbax data files (under d/ folders) of a checkpoint directory, largest first."""
  files = [p for p in glob.glob(os.path.join(str(directory), "**", "*"), recursive=True)
           if os.path.isfile(p) and os.sep + "d" + os.sep in p]
  return sorted(files, key=os.path.getsize, reverse=True)


def flip_byte(path, at=0.5) -> None:
  with open(path, "r+b") as f:
    size = os.path.getsize(path)
    f.seek(int(size * at))
    b = f.read(1)
    f.seek(int(size * at))
    f.write(bytes([b[0] ^ 0xFF]))


def truncate(path, keep=0.5) -> None:
  with open(path, "r+b") as f:
    f.truncate(int(os.path.getsize(path) * keep))


def edit_json(path, fn) -> None:
  with open(path) as f:
    obj = json.load(f)
  fn(obj)
  with open(path, "w") as f:
    json.dump(obj, f)


# ----------------------------------------------------------------------------------------------------------
# The base: one tiny byte-level run (checkpoints at steps 2 and 4, export), its datastore + flat index, a
# consecutive batch plan, and a tiny word-level export. Built once; cases damage copies of it.
# ----------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base(tmp_path_factory):
  from tests.helpers import config_file, write_text_file, write_wikitext_dir

  tmp = tmp_path_factory.mktemp("rel")
  corpus = write_text_file(tmp / "text.bin", 40_000)
  (tmp / "bytes").mkdir()
  cfg = config_file(tmp / "bytes", corpus, **{"train.num_steps": 4, "train.checkpoint_every": 2,
                                               "train.eval_max_tokens": 200, "eval.max_tokens": 200})
  wiki = write_wikitext_dir(str(tmp / "wiki"))
  (tmp / "words").mkdir()
  wcfg = config_file(tmp / "words", corpus, **{"data.corpus": "wikitext", "data.path": wiki, "train.num_steps": 2,
                                               "data.segment_len": 16, "model.max_len": 32, "eval.block_len": 32,
                                               "eval.context_window": 16})
  work, wwork = tmp / "run", tmp / "wrun"
  cases = [
      {"module": "trime_jax.launch.train", "args": [f"--config={cfg}", f"--workdir={work}"]},
      {"module": "trime_jax.launch.build_datastore",
       "args": [f"--config={cfg}", f"--checkpoint={work}/export", f"--out={tmp}/ds", "--split=dev"]},
      {"module": "trime_jax.launch.make_batches",
       "args": [f"--config={cfg}", "--kind=consecutive", f"--out={tmp}/plan", "--config.trime.memory=long",
                "--config.trime.consecutive_segments=2"]},
  ]
  t0 = time.perf_counter()
  results = run_cases(cases, tmp / "base_out")
  print(f"\nbase: {time.perf_counter() - t0:.1f} s: " + ", ".join(f"{r['seconds']:.1f}" for r in results))
  for c, r in zip(cases, results):
    assert r["rc"] == 0, (c, r["err"][-3000:])
  assert sorted(os.listdir(work / "checkpoints")) == ["2", "4"]
  assert "index: auto chose exact" in results[1]["out"]  # the choice is stated, with its cost estimate
  # A word-level export without training one: the byte export with a 256-word vocabulary (same shapes).
  from trime_jax import data

  shutil.copytree(work / "export", wwork / "export")
  words = data.Vocab([f"w{i}" for i in range(256)], kind="words")
  (wwork / "export" / "vocab.json").write_text(json.dumps(words.to_json()))
  edit_json(wwork / "export" / "meta.json", lambda m: m.update(vocab_fingerprint=words.fingerprint(),
                                                               vocab_kind="words"))
  return {"tmp": tmp, "corpus": corpus, "cfg": cfg, "wcfg": wcfg, "work": work, "wwork": wwork, "ds": tmp / "ds",
          "plan": tmp / "plan", "wiki": wiki, "build_out": results[1]["out"]}


def _copy(base, what, name):
  dst = base["tmp"] / "cases" / name
  shutil.copytree(base[what], dst)
  return dst


def _meta(export):
  with open(os.path.join(str(export), "meta.json")) as f:
    return json.load(f)


# ----------------------------------------------------------------------------------------------------------
# Cases. Each builder damages a copy and returns (case, [substrings of the error line]); the table is run in one
# driver call and each row is its own test.
# ----------------------------------------------------------------------------------------------------------
def _eval(b, export, *extra, cfg=None):
  return {"module": "trime_jax.launch.eval", "args": [f"--config={cfg or b['cfg']}", f"--checkpoint={export}", *extra]}


def _eval_ext(b, export, ds, *extra):
  # The base datastore holds the dev split these rows evaluate: split leakage, allowed here on purpose (the rows
  # are about damaged files; tests/test_reliability_cli.py has the leakage rows).
  return {"module": "trime_jax.launch.eval_ext", "args": [f"--config={b['cfg']}", f"--checkpoint={export}",
                                                f"--config.eval.datastore={ds}", "--config.eval.knn_k=8",
                                                "--allow_split_overlap", *extra]}


def _train(b, work, *extra, cfg=None):
  return {"module": "trime_jax.launch.train", "args": [f"--config={cfg or b['cfg']}", f"--workdir={work}", *extra]}


def e_params_flipped(b):
  x = _copy(b, "work", "flip") / "export"
  flip_byte(data_files(x / "params")[0])
  return _eval(b, x), ["params_digest", str(x / "params")]


def e_arch_edited(b):
  x = _copy(b, "work", "heads") / "export"
  edit_json(x / "config.json", lambda c: c["model"].update(num_heads=4))  # d_model 32: 2 -> 4 heads, same shapes
  return _eval(b, x), ["config.json", "architecture"]


def _truncated(name):
  def build(b):
    x = _copy(b, "work", f"trunc_{name}") / "export"
    truncate(x / name)
    return _eval(b, x), [str(x / name), "truncated"]

  build.__name__ = f"e_truncated_{name.replace('.', '_')}"
  return build


def e_params_metadata_deleted(b):
  x = _copy(b, "work", "nometa") / "export"
  os.remove(x / "params" / "_METADATA")
  return _eval(b, x), [str(x / "params" / "_METADATA"), "missing"]


def e_params_data_deleted(b):
  x = _copy(b, "work", "nodata") / "export"
  gone = data_files(x / "params")[0]
  os.remove(gone)
  return _eval(b, x), [str(x / "params"), "damaged", f"{gone} is missing"]


def e_params_data_truncated(b):  # meta.json's params_files: named before orbax reads (and fails midway)
  x = _copy(b, "work", "truncdata") / "export"
  cut = data_files(x / "params")[0]
  truncate(cut)
  return _eval(b, x), [str(x / "params"), "damaged", str(cut), "truncated"]


def e_eval_max_tokens(b):
  return _eval(b, b["work"] / "export", "--config.eval.max_tokens=-5"), ["eval.max_tokens"]


def e_eval_batch_size(b):
  return _eval(b, b["work"] / "export", "--config.eval.batch_size=0"), ["eval.batch_size"]


def e_eval_knn_lambda(b):
  return _eval(b, b["work"] / "export", "--config.eval.knn_lambda=1.5"), ["eval.knn_lambda"]


def e_eval_split(b):
  return _eval(b, b["work"] / "export", "--config.eval.split=valid"), ["eval.split", "'valid'"]


def e_log_every(b):
  return _train(b, b["tmp"] / "cases" / "log0", "--config.train.log_every=0"), ["train.log_every"]


def e_num_heads(b):
  return _train(b, b["tmp"] / "cases" / "heads3", "--config.model.num_heads=3"), ["model.num_heads"]


def e_config_missing(b):
  return _eval(b, b["work"] / "export", cfg=str(b["tmp"] / "no_such_config.py")), ["--config file not found",
                                                                                    "no_such_config.py"]


def e_data_dir_missing(b):
  case = _eval(b, b["work"] / "export", "--config.data.corpus=wikitext_mini", "--config.data.path=no/such/wt2")
  return case, ["no/such/wt2", "looked in", "--config.data.path"]


def e_non_utf8_corpus(b):
  wiki = _copy(b, "wiki", "wiki_bad")
  lines = (wiki / "wiki.train.tokens").read_bytes().split(b"\n")
  lines[4] += b" caf\xe9"  # Latin-1, not UTF-8
  (wiki / "wiki.train.tokens").write_bytes(b"\n".join(lines))
  case = _train(b, b["tmp"] / "cases" / "wbad", f"--config.data.path={wiki}", cfg=b["wcfg"])
  return case, [str(wiki / "wiki.train.tokens"), "line 5", "UTF-8"]


def e_word_export_byte_config(b):
  return _eval(b, b["wwork"] / "export"), ["data.corpus='bytes'", "words", "trained with"]


def e_workdir_other_seed(b):
  w = _copy(b, "work", "seed")
  return _train(b, w, "--config.train.seed=1"), ["train.seed", "allow_config_change"]


def e_workdir_other_memory(b):
  w = _copy(b, "work", "memory")
  return _train(b, w, "--config.trime.memory=none"), ["trime.memory", "'local' there, 'none' now"]


def e_batches_truncated(b):
  plan = _copy(b, "plan", "plan_trunc")
  truncate(plan / "batches.npy")
  case = _train(b, b["tmp"] / "cases" / "plan_run", "--config.trime.memory=long", "--config.trime.batching=consecutive",
                "--config.trime.consecutive_segments=2", f"--config.trime.batch_plan={plan}")
  return case, [str(plan / "batches.npy"), "truncated"]


def e_batch_plan_missing(b):
  case = _train(b, b["tmp"] / "cases" / "noplan", "--config.trime.memory=long", "--config.trime.batching=consecutive",
                "--config.trime.consecutive_segments=2", "--config.trime.batch_plan=runs/no_such_plan")
  return case, ["runs/no_such_plan", "repo root", "--config.trime.batch_plan"]


def e_datastore_keys_flipped(b):
  ds = _copy(b, "ds", "ds_flip")
  flip_byte(ds / "keys.npy", 0.7)
  return _eval_ext(b, b["work"] / "export", ds), [str(ds / "keys.npy"), "digest", "rebuild"]


def e_datastore_meta_truncated(b):
  ds = _copy(b, "ds", "ds_meta")
  truncate(ds / "meta.json")
  return _eval_ext(b, b["work"] / "export", ds), [str(ds / "meta.json"), "truncated"]


def e_datastore_meta_edited(b):
  ds = _copy(b, "ds", "ds_edit")
  edit_json(ds / "meta.json", lambda m: m.update(key_type="final"))
  return _eval_ext(b, b["work"] / "export", ds), [str(ds / "meta.json"), "edited"]


def e_index_flipped(b):
  ds = _copy(b, "ds", "ds_index")
  flip_byte(ds / "index.faiss", 0.6)
  return _eval_ext(b, b["work"] / "export", ds), [str(ds / "index.faiss"), "digest"]


def e_workdir_is_file(b):
  f = b["tmp"] / "cases" / "a_file"
  f.parent.mkdir(exist_ok=True)
  f.write_text("not a folder\n")
  return _train(b, f), [f"--workdir={f}", "is a file, not a folder"]


def e_workdir_missing(b):
  return {"module": "trime_jax.launch.train", "args": [f"--config={b['cfg']}"]}, ["--workdir is required"]


def e_workdir_config_typo(b):
  w = _copy(b, "work", "typo")
  edit_json(w / "config.json", lambda c: c["train"].update(lerning_rate=1.0))
  return _train(b, w), [str(w / "config.json"), "train.lerning_rate (train.learning_rate?)"]


def e_export_target_other(b):
  w = b["tmp"] / "cases" / "export_other"
  (w / "export").mkdir(parents=True)
  (w / "export" / "notes.txt").write_text("mine\n")
  return _train(b, w), [str(w / "export"), "not an export", "notes.txt"]


def e_export_target_other_model(b):
  w = _copy(b, "work", "export_model")  # its export/ says another training corpus: another model
  shutil.rmtree(w / "checkpoints")
  edit_json(w / "export" / "meta.json", lambda m: m.update(train_fingerprint="0123456789abcdef"))
  return _train(b, w), [str(w / "export"), "another model", "train_fingerprint"]


ERROR_CASES = [e_params_flipped, e_arch_edited, _truncated("vocab.json"), _truncated("config.json"),
               _truncated("meta.json"), e_params_metadata_deleted, e_params_data_deleted, e_params_data_truncated,
               e_eval_max_tokens,
               e_eval_batch_size, e_eval_knn_lambda, e_eval_split, e_log_every, e_num_heads, e_config_missing,
               e_data_dir_missing, e_non_utf8_corpus,
               e_word_export_byte_config, e_workdir_other_seed, e_workdir_other_memory, e_batches_truncated,
               e_batch_plan_missing, e_datastore_keys_flipped, e_datastore_meta_truncated, e_datastore_meta_edited,
               e_index_flipped, e_workdir_is_file, e_workdir_missing, e_workdir_config_typo, e_export_target_other,
               e_export_target_other_model]


# Recovery cases: (builder -> (cases, state)) and a check(results, state, base).
def r_checkpoint_fallback(kind):
  def build(b):
    w = _copy(b, "work", f"fallback_{kind}")
    newest = w / "checkpoints" / "4" / "default"
    if kind == "metadata_deleted":
      os.remove(newest / "_METADATA")
    elif kind == "data_deleted":
      os.remove(data_files(newest)[0])
    elif kind == "bit_flipped":  # orbax reads it without complaint: only the step's digest sees it
      flip_byte(data_files(newest)[0], 0.3)
    else:
      truncate(data_files(newest)[0])
    return [_train(b, w)], w

  def check(rs, w, b):
    r = rs[0]
    assert r["rc"] == 0, r["err"][-3000:]
    assert "Traceback" not in r["err"] and "Event loop is closed" not in r["err"], r["err"][-3000:]
    assert "checkpoint at step 4" in r["out"] and "falling back to the checkpoint at step 2" in r["out"], r["out"]
    assert "resumed from step 2" in r["out"]
    warnings = [ln for ln in r["out"].splitlines() + r["err"].splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1 and f"checkpoint at step 4 in {w / 'checkpoints'}" in warnings[0], warnings
    if kind == "bit_flipped":
      assert "changed after it was saved" in warnings[0], warnings
    assert os.path.isdir(w / "checkpoints_damaged" / "4")  # kept for inspection, out of orbax's way
    # Resumed from step 2, the rerun reaches the uninterrupted run's parameters bit for bit.
    assert _meta(w / "export")["params_digest"] == _meta(b["work"] / "export")["params_digest"]

  build.__name__ = check.__name__ = f"r_checkpoint_fallback_{kind}"
  return build, check


def r_allowed_config_change():
  def build(b):
    w = _copy(b, "work", "allowed")
    return [_train(b, w, "--config.train.seed=1", "--config.train.allow_config_change=True")], w

  def check(rs, w, b):
    assert rs[0]["rc"] == 0, rs[0]["err"][-3000:]
    with open(w / "config_changes.jsonl") as f:
      rec = json.loads(f.readline())
    assert rec["changes"]["train.seed"] == [0, 1] and rec["allowed"]
    assert json.loads((w / "config.json").read_text())["train"]["seed"] == 1  # config.json says what ran

  build.__name__ = check.__name__ = "r_allowed_config_change"
  return build, check


def r_finished_rerun():
  def build(b):
    w = _copy(b, "work", "finished")
    return [_train(b, w), _train(b, w, "--config.train.num_steps=5")], w

  def check(rs, w, b):
    assert all(r["rc"] == 0 for r in rs), [r["err"][-2000:] for r in rs]
    with open(w / "metrics.jsonl") as f:
      rows = [json.loads(ln) for ln in f]
    dev = [(r["step"]) for r in rows if r.get("split") == "dev"]
    assert dev == [4, 5], dev  # the rerun at 4 steps added no duplicate; extending the run (free change) adds one
    assert "train.num_steps 4 -> 5" in rs[1]["out"]

  build.__name__ = check.__name__ = "r_finished_rerun"
  return build, check


_NO_SPACE = """
import errno, os
def _full(*a, **k):
  raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
"""


def r_datastore_disk_full():
  def build(b):
    out = b["tmp"] / "cases" / "ds_full"
    args = [f"--config={b['cfg']}", f"--checkpoint={b['work']}/export", f"--out={out}", "--split=dev"]
    # 1: no space for the files (posix_fallocate fails); 2: space runs out writing progress after the first chunk;
    # 3: space freed, the same command completes.
    fallocate = _NO_SPACE + "os.posix_fallocate = _full\n"
    # 2 uses chunks of 1,024 tokens (of 4,000) so the first chunk is saved before the disk fills.
    meta_write = _NO_SPACE + ("from trime_jax import data\nfrom trime_jax.datastore import build\n"
                              "build.build_datastore.__wrapped__.__kwdefaults__['chunk_tokens'] = 1024\n"
                              "_w = data.atomic_write_json\n"
                              "def _meta(path, obj):\n  if obj.get('tokens_done', 0) > 1024:\n    _full()\n"
                              "  _w(path, obj)\n"
                              "data.atomic_write_json = _meta\n")
    # 0: a kernel-enforced file size limit (RLIMIT_FSIZE, like a small filesystem; SIGXFSZ ignored -> EFBIG).
    rlimit = ("import resource, signal\nsignal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
              "resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))\n")
    return [{"module": "trime_jax.launch.build_datastore", "args": args, "setup": rlimit},
            {"module": "trime_jax.launch.build_datastore", "args": args, "setup": fallocate},
            {"module": "trime_jax.launch.build_datastore", "args": args, "setup": meta_write},
            {"module": "trime_jax.launch.build_datastore", "args": args}], out

  def check(rs, out, b):
    line = one_error_line(rs[0])
    assert "file size limit reached" in line and str(out) in line and "rerun the same command" in line, line
    for r, saved in zip(rs[1:3], ("0 of 4,000", "1,024 of 4,000")):
      line = one_error_line(r)
      assert "no space left" in line and str(out) in line and "rerun the same command" in line, line
      assert f"{saved} tokens are saved" in line, line
    assert "this call wrote 2,976 tokens" in rs[3]["out"], rs[3]["out"]  # resumed after the saved chunk
    assert rs[3]["rc"] == 0, rs[3]["err"][-3000:]
    for name in ("keys.npy", "values.npy", "index.faiss"):
      assert (out / name).read_bytes() == (b["ds"] / name).read_bytes(), name

  build.__name__ = check.__name__ = "r_datastore_disk_full"
  return build, check


# A process that holds a workdir's lock as a running training does (the lock file's format, flock), until the
# case's process exits (its stdin closes); its pid is written to `pidfile` for the check.
_HOLDER = (
    "import fcntl, json, os, sys\n"
    "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
    "fcntl.flock(fd, fcntl.LOCK_EX)\n"
    "os.write(fd, json.dumps({'pid': os.getpid(), 'host': os.uname().nodename, 'since': 'now'}).encode())\n"
    "print('held', flush=True)\n"
    "sys.stdin.read()\n")
_HOLD_LOCK = """
import subprocess, sys
_holder = subprocess.Popen([sys.executable, "-c", {holder!r}, {lock!r}], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
_holder.stdout.readline()
open({pidfile!r}, "w").write(str(_holder.pid))
"""


def r_workdir_locked():
  def build(b):
    w = _copy(b, "work", "locked")
    pidfile = str(b["tmp"] / "cases" / "locked.pid")
    setup = _HOLD_LOCK.format(holder=_HOLDER, lock=str(w / ".lock"), pidfile=pidfile)
    before = tree_hashes(w)
    return [_train(b, w, "--config.train.num_steps=6") | {"setup": setup}], (w, pidfile, before)

  def check(rs, state, b):
    w, pidfile, before = state
    line = one_error_line(rs[0])
    with open(pidfile) as f:
      pid = f.read().strip()
    assert f"workdir {w} is in use by process {pid}" in line, line
    after = {k: v for k, v in tree_hashes(w).items() if not k.endswith(".lock")}  # the holder's own file
    assert after == before  # the second run changed nothing (no metrics line, no checkpoint)

  build.__name__ = check.__name__ = "r_workdir_locked"
  return build, check


# Ctrl-C (KeyboardInterrupt) raised where the run saves update `step`, after the earlier save has finished.
_CTRL_C_AT = """
from trime_jax import checkpoint
_save = checkpoint.save
def _interrupted(mgr, step, state):
  if step == {step}:
    checkpoint.finish(mgr)
    raise KeyboardInterrupt
  _save(mgr, step, state)
checkpoint.save = _interrupted
"""


def r_interrupted():
  def build(b):
    w = b["tmp"] / "cases" / "ctrl_c"
    return [_train(b, w) | {"setup": _CTRL_C_AT.format(step=2)},  # before the first checkpoint
            _train(b, w) | {"setup": _CTRL_C_AT.format(step=4)},  # after it
            _train(b, w)], w

  def check(rs, w, b):
    for r in rs[:2]:
      assert r["rc"] == 130 and "Traceback" not in r["err"], r["err"][-3000:]
      assert "intact" not in r["err"], r["err"]
    assert "interrupted: no checkpoint had been written yet" in rs[0]["err"], rs[0]["err"]
    assert f"interrupted: the newest checkpoint on disk is step 2 in {w / 'checkpoints'}" in rs[1]["err"], rs[1]["err"]
    assert rs[2]["rc"] == 0, rs[2]["err"][-3000:]
    with open(w / "metrics.jsonl") as f, open(b["work"] / "metrics.jsonl") as g:
      steps, want = ([(r["step"], r.get("split")) for r in map(json.loads, h)] for h in (f, g))
    assert steps == want, (steps, want)  # each line once, as in the uninterrupted run
    assert _meta(w / "export")["params_digest"] == _meta(b["work"] / "export")["params_digest"]

  build.__name__ = check.__name__ = "r_interrupted"
  return build, check


# A file-size limit (RLIMIT_FSIZE, like a small filesystem; r_training_disk_full sets it).
_SMALL_DISK = ("import resource, signal\nsignal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
               "resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))\n")


def r_training_disk_full():
  def build(b):
    w = b["tmp"] / "cases" / "train_full"
    # A file size limit between what a training writes before its first checkpoint (config, metrics, event file:
    # bounded by their sizes at the end of the base run) and the checkpoint's _METADATA file. Not the data files:
    # how OCDBT splits a checkpoint into data files varies from run to run (one 180 kB file, or several small
    # ones that all fit under a limit set from another run's largest: seen in CI).
    work = b["work"]
    before = max(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(work) for f in fs
                 if not os.path.relpath(d, work).split(os.sep)[0] in ("checkpoints", "export", "best"))
    metadata = os.path.getsize(work / "checkpoints" / "2" / "default" / "_METADATA")
    assert before < metadata, (before, metadata)
    limit = (before + metadata) // 2
    # And a limit the TensorBoard event file meets first: it holds the config's text (config.json) and more.
    tb_limit = os.path.getsize(work / "config.json") + 1
    return [_train(b, w) | {"setup": _SMALL_DISK.format(limit=limit)}, _train(b, w),
            _train(b, w.with_name("train_full_tb")) | {"setup": _SMALL_DISK.format(limit=tb_limit)}], w

  def check(rs, w, b):
    line = one_error_line(rs[0])
    assert "no space left writing the checkpoint of update 2" in line and str(w / "checkpoints") in line, line
    assert "rerun the same command" in line, line
    assert rs[1]["rc"] == 0, rs[1]["err"][-3000:]
    assert _meta(w / "export")["params_digest"] == _meta(b["work"] / "export")["params_digest"]
    # tensorboardX's writes name no file, and its writer thread prints its own traceback: one line, with the path.
    line = one_error_line(rs[2])
    assert f"File too large: {w.with_name('train_full_tb') / 'tb'}" in line and "ulimit -f" in line, line

  build.__name__ = check.__name__ = "r_training_disk_full"
  return build, check


RECOVERY_CASES = [r_checkpoint_fallback("bit_flipped"), r_workdir_locked(), r_interrupted(), r_training_disk_full(),
                  r_checkpoint_fallback("metadata_deleted"), r_checkpoint_fallback("data_deleted"),
                  r_checkpoint_fallback("data_truncated"), r_allowed_config_change(), r_finished_rerun(),
                  r_datastore_disk_full()]


@pytest.fixture(scope="module")
def results(base):
  """Build every case on its own copy, hash the user's files, run all cases in one driver call."""
  cases, spans, rows = [], {}, {}
  user_files = [base["corpus"], base["cfg"], base["wcfg"], base["wiki"]]
  for build in ERROR_CASES:
    case, expect = build(base)
    prefixes = ("--checkpoint=", "--config.eval.datastore=", "--config.data.path=", "--config.trime.batch_plan=",
                "--workdir=")
    watched = [a.split("=", 1)[1] for a in case["args"] if a.startswith(prefixes)]
    watched = [p for p in watched if os.path.exists(p)] + user_files
    before = tree_hashes(*watched)
    spans[build.__name__] = (len(cases), 1)
    rows[build.__name__] = (expect, watched, before)
    cases.append(case)
  for build, check in RECOVERY_CASES:
    group, state = build(base)
    spans[build.__name__] = (len(cases), len(group))
    rows[build.__name__] = (check, state)
    cases += group
  t0 = time.perf_counter()
  out = run_cases(cases, base["tmp"] / "cases_out")
  print(f"\n{len(cases)} CLI cases in {time.perf_counter() - t0:.1f} s: "
        + ", ".join(f"{c['module'].split('.')[1]} {r['seconds']:.1f}" for c, r in zip(cases, out)))
  return {name: (out[a:a + n], rows[name]) for name, (a, n) in spans.items()}


@pytest.mark.parametrize("build", ERROR_CASES, ids=lambda f: f.__name__)
def test_error_case(results, build):
  (r,), (expect, watched, before) = results[build.__name__]
  line = one_error_line(r)
  for s in expect:
    assert s in line, (s, line)
  assert tree_hashes(*watched) == before  # nothing the user had was changed


@pytest.mark.parametrize("case", RECOVERY_CASES, ids=lambda c: c[0].__name__)
def test_recovery_case(results, base, case):
  build, _ = case
  rs, (check, state) = results[build.__name__]
  check(rs, state, base)


def test_index_choice_states_the_cost():
  from trime_jax.datastore.index import index_choice

  # wikitext-mini's store (375k keys of D=128) searched for dev + test (87k queries) with K=1024: IVF-PQ.
  kind, why = index_choice(375_000, 128, 87_000, 1024)
  assert kind == "ivfpq" and "87,000 searches of K=1024" in why and "exact ~" in why
  # The same store searched a thousand times: the exact index is cheaper than training IVF-PQ.
  assert index_choice(375_000, 128, 1_000, 1024)[0] == "flat"
  # Too few candidates in nprobe lists for K: exact.
  assert index_choice(20_000, 128, 10 ** 7, 1024, nprobe=1)[0] == "flat"


def test_base_build_states_index_choice(base):
  assert "searches of K=1024" in base["build_out"] and "exact ~" in base["build_out"]


def test_multiprocess_peer_killed(tmp_path):
  """Two CPU processes train together; process 1 is killed: process 0 stops within the heartbeat timeout,
  saying another task died (JAX's coordination service), instead of hanging in a collective."""
  import signal

  from tests.helpers import config_file, two_process_env, write_text_file

  corpus = write_text_file(tmp_path / "text.bin", 40_000)
  cfg = config_file(tmp_path, corpus, **{"train.num_steps": 10_000, "train.log_every": 2,
                                         "train.checkpoint_every": 1_000, "train.batch_size": 8})
  env = two_process_env(2, TRIME_HEARTBEAT_TIMEOUT_S="10")
  work = tmp_path / "run"
  procs = [subprocess.Popen([sys.executable, "-m", "trime_jax.distributed", "trime_jax.launch.train", f"--config={cfg}",
                             f"--workdir={work}"], cwd=REPO, env=dict(env, JAX_PROCESS_ID=str(i)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
  try:
    deadline = time.time() + 400
    while not (work / "metrics.jsonl").exists() or not (work / "metrics.jsonl").read_text().strip():
      assert time.time() < deadline and all(p.poll() is None for p in procs), "training did not start"
      time.sleep(0.5)
    procs[1].send_signal(signal.SIGKILL)
    t0 = time.time()
    _, err = procs[0].communicate(timeout=120)
    waited = time.time() - t0
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  print(f"\nprocess 0 stopped {waited:.1f} s after process 1 was killed (heartbeat timeout 10 s)")
  assert procs[0].returncode != 0
  assert "another task died" in err, err[-3000:]
  assert waited < 60, waited


def test_multiprocess_refusals_stop_every_process(tmp_path):
  """What only process 0 checks or writes (export/ and best/, the workdir's lock, metrics.jsonl during training)
  stops every process of a run with its error, at once: none goes on into a collective to wait there for a
  process 0 that is gone."""
  from tests.helpers import config_file, two_process_env, write_text_file
  from trime_jax.runtime.lock import DirLock

  corpus = write_text_file(tmp_path / "text.bin", 20_000)
  cfg = config_file(tmp_path, corpus, **{"train.num_steps": 2, "train.batch_size": 4})

  def run_both(work):
    env = two_process_env(2)
    procs = [subprocess.Popen([sys.executable, "-m", "trime_jax.distributed", "trime_jax.launch.train",
                               f"--config={cfg}", f"--workdir={work}"], cwd=REPO, env=dict(env, JAX_PROCESS_ID=str(i)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    t0 = time.time()
    try:
      errs = [p.communicate(timeout=240)[1] for p in procs]
    finally:
      for p in procs:
        if p.poll() is None:
          p.kill()
          p.wait()
    return [p.returncode for p in procs], [[l for l in e.splitlines() if l.startswith("error:")] for e in errs], \
        time.time() - t0

  junk = tmp_path / "junk"
  (junk / "export").mkdir(parents=True)
  (junk / "export" / "notes.txt").write_text("mine")
  held = tmp_path / "held"
  held.mkdir()
  # metrics.jsonl, written by process 0 only, cannot be written (here: a link into a folder that is not there; a
  # full disk alike): its first line fails after the first update, in the middle of training
  records = tmp_path / "records"
  records.mkdir()
  (records / "metrics.jsonl").symlink_to(tmp_path / "gone" / "metrics.jsonl")
  with DirLock(str(held / ".lock"), f"workdir {held}"):  # another run holds the workdir
    for work, says in [(junk, "not an export"), (held, "in use"), (records, "No such file or directory")]:
      codes, errors, took = run_both(work)
      print(f"\n{work.name}: both processes ended in {took:.1f} s: {errors}")
      assert codes == [2, 2], (codes, errors)
      assert len(errors[0]) == 1 and says in errors[0][0], errors
      assert len(errors[1]) == 1 and errors[1][0].startswith("error: process 0 stopped (")
      assert errors[0][0][len("error: "):] in errors[1][0], errors  # process 0's own words
      assert took < 120, took  # start-up included; a process left waiting would take the shutdown timeout or more
  assert (junk / "export" / "notes.txt").read_text() == "mine" and not (junk / "checkpoints").exists()


if __name__ == "__main__":
  _driver(sys.argv[1], sys.argv[2])

"""The launch CLIs end to end on a tiny config, and bad input as one clear `error:` line (no traceback)."""

import json
import os
import shutil

import pytest

from tests.helpers import config_file, run_cli, write_text_file


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("cli")
  corpus = write_text_file(tmp / "text.bin", 40_000)
  cfg = config_file(tmp, corpus)
  work = tmp / "run"
  r = run_cli("trime_jax.launch.train", f"--config={cfg}", f"--workdir={work}", "--config.train.num_steps=4")
  assert r.returncode == 0, r.stderr[-3000:]
  assert "exported" in r.stdout and os.path.isdir(work / "export")
  return tmp, corpus, cfg, work


def _one_error_line(r):
  assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
  assert "Traceback" not in r.stderr
  errors = [l for l in r.stderr.splitlines() if l.startswith("error:")]
  assert len(errors) == 1, r.stderr
  return errors[0]


def test_train_then_eval_cli(trained):
  tmp, _, cfg, work = trained
  out = tmp / "eval.json"
  r = run_cli("trime_jax.launch.eval", f"--config={cfg}", f"--checkpoint={work}/export", "--config.eval.memory=cache",
              "--config.eval.split=test", f"--output={out}", f"--config.eval.datastore={tmp}/no_ds")
  assert r.returncode == 0, r.stderr[-3000:]
  assert f"note: eval.datastore={tmp}/no_ds is not read by trime_jax.launch.eval" in r.stderr  # not silently
  rows = json.loads(out.read_text())
  assert [x["variant"] for x in rows][0] == "none" and rows[1]["variant"].startswith("cache(")
  assert all(x["tokens"] > 0 and x["ppl"] > 1 and "bpc" in x for x in rows)
  assert "| variant" in r.stdout
  # --include of rows the summary cannot choose between with this run's (the cache at another λ, θ on test, no dev
  # perplexity): found after the evaluation, one error line that says where this evaluation's rows are
  other = {k: v for k, v in rows[1].items() if k not in ("checkpoint_fingerprint", "best")}
  other.update(variant="cache(lambda=0.5,theta=9)", params={"cache_lambda": 0.5, "cache_theta": 9.0})
  (tmp / "other.json").write_text(json.dumps([other]))
  r = run_cli("trime_jax.launch.eval", f"--config={cfg}", f"--checkpoint={work}/export", "--config.eval.memory=cache",
              "--config.eval.split=test", f"--include={tmp / 'other.json'}")
  line = _one_error_line(r)
  assert "no dev perplexity to choose between them" in line and line.endswith(
      "(this evaluation's rows are in the table above; --output would keep them as a file)"), line
  assert "| variant" in r.stdout  # the table above


def test_unknown_config_field(trained):
  _, _, cfg, work = trained
  line = _one_error_line(run_cli("trime_jax.launch.train", f"--config={cfg}", f"--workdir={work}x",
                                 "--config.train.num_stpes=3"))
  assert "num_stpes" in line and "num_steps" in line
  # the override and the field named once each, ml_collections' suggestion kept
  assert "--config.train.num_stpes: the config has no field train.num_stpes (Did you mean \"num_steps\"" in line


def test_missing_and_empty_data(trained):
  tmp, _, cfg, _ = trained
  line = _one_error_line(run_cli("trime_jax.launch.train", f"--config={cfg}", f"--workdir={tmp}/m",
                                 f"--config.data.path={tmp}/nope.bin"))
  assert "not found" in line
  empty = tmp / "empty.bin"
  empty.write_bytes(b"")
  line = _one_error_line(run_cli("trime_jax.launch.train", f"--config={cfg}", f"--workdir={tmp}/e",
                                 f"--config.data.path={empty}"))
  assert "empty" in line


def test_checkpoint_vocabulary_mismatch(trained):
  tmp, _, cfg, work = trained
  broken = tmp / "broken_export"
  shutil.copytree(work / "export", broken)
  vocab = json.loads((broken / "vocab.json").read_text())
  vocab["tokens"] = vocab["tokens"][:-1]  # a vocabulary that is not the one the model was trained with
  vocab.pop("fingerprint")
  (broken / "vocab.json").write_text(json.dumps(vocab))
  line = _one_error_line(run_cli("trime_jax.launch.eval", f"--config={cfg}", f"--checkpoint={broken}"))
  assert "vocabulary mismatch" in line
  # A byte-level checkpoint evaluated on a word-level corpus.
  wiki = tmp / "wiki"
  from tests.helpers import write_wikitext_dir

  write_wikitext_dir(wiki)
  line = _one_error_line(run_cli("trime_jax.launch.eval", f"--config={cfg}", f"--checkpoint={work}/export",
                                 "--config.data.corpus=wikitext", f"--config.data.path={wiki}"))
  assert "does not match" in line
  line = _one_error_line(run_cli("trime_jax.launch.eval", f"--config={cfg}", f"--checkpoint={tmp}/no_such_export"))
  assert "not found" in line
  # more evaluation devices than this process has (one CPU device here)
  line = _one_error_line(run_cli("trime_jax.launch.eval", f"--config={cfg}", f"--checkpoint={work}/export",
                                 "--config.eval.devices=2"))
  assert line == "error: eval.devices=2 but this process sees 1 device"


def test_datastore_and_external_memory_eval_cli(trained):
  tmp, _, cfg, work = trained
  ds = tmp / "ds"
  r = run_cli("trime_jax.launch.build_datastore", f"--config={cfg}", f"--checkpoint={work}/export", f"--out={ds}",
              "--index=flat")
  assert r.returncode == 0, r.stderr[-3000:]
  # the key pass's devices: --devices, else eval.devices (one setting for evaluation and the key pass)
  for flag, said in (("--config.eval.devices=2", "eval.devices=2"), ("--devices=3", "--devices=3")):
    line = _one_error_line(run_cli("trime_jax.launch.build_datastore", f"--config={cfg}",
                                   f"--checkpoint={work}/export", f"--out={tmp}/ds_devices", flag))
    assert line == f"error: {said} but only 1 devices are visible", line
    assert not (tmp / "ds_devices").exists()  # refused before anything is written
  # a subset (the paper's datastore-size sweep) says what it wrote, and on a rerun that it was there
  for said in ("copied in", "there already"):
    r = run_cli("trime_jax.launch.build_datastore", f"--config={cfg}", f"--checkpoint={work}/export",
                f"--out={tmp}/ds_sub", f"--subset_of={ds}", "--entries=100", "--index=none")
    assert r.returncode == 0 and f"datastore {tmp}/ds_sub: the first 100 entries of {ds} (" in r.stdout, r.stderr
    assert said in r.stdout, r.stdout
  out = tmp / "ext.json"
  r = run_cli("trime_jax.launch.eval_ext", f"--config={cfg}", f"--checkpoint={work}/export",
              f"--config.eval.datastore={ds}", "--config.eval.knn_k=16", "--config.eval.tune=True",
              "--config.eval.split=test", "--throughput_tokens=256", f"--output={out}")
  assert r.returncode == 0, r.stderr[-3000:]
  res = json.loads(out.read_text())
  assert res["devices"] == 1  # eval.devices (default 1)
  assert {row["family"] for row in res["rows"]} == {"none", "cache", "trime_local", "trime", "interp", "knnlm",
                                                    "knnlm_cache"}
  assert all(row["test_ppl"] > 1 and row["dev_ppl"] > 1 for row in res["rows"])
  acc = res["retrieval_accuracy"]
  ranks = [int(name[3:]) for name in acc]  # the ranks the top-K search tells apart (knn.retrieval_ks)
  assert ranks == sorted(ranks) and ranks[0] == 1 and ranks[-1] == res["k"] <= 1024
  assert 0 <= min(acc.values()) and list(acc.values()) == sorted(acc.values()) and max(acc.values()) <= 1
  assert res["throughput"]["ratio"] > 0 and "top-K retrieval accuracy" in r.stdout
  line = _one_error_line(run_cli("trime_jax.launch.eval_ext", f"--config={cfg}", f"--checkpoint={work}/export"))
  assert "eval.datastore" in line


def test_knnlm_by_l2_needs_the_l2_index_and_build_datastore_adds_it(trained):
  """eval.knnlm_metric=l2 (the original's kNN-LM): without the datastore's L2 index, one `error:` line naming the
  command that builds it; build_datastore --index_metric=l2 adds it to the datastore (keys reused), and eval_ext
  then scores the kNN-LM families by L2."""
  tmp, _, cfg, work = trained
  ds = tmp / "ds_l2"
  build = ("trime_jax.launch.build_datastore", f"--config={cfg}", f"--checkpoint={work}/export", f"--out={ds}",
           "--index=flat")
  r = run_cli(*build)
  assert r.returncode == 0, r.stderr[-3000:]
  ext = ("trime_jax.launch.eval_ext", f"--config={cfg}", f"--checkpoint={work}/export",
         f"--config.eval.datastore={ds}", "--config.eval.knn_k=16", "--config.eval.split=test",
         "--config.eval.max_tokens=200",
         "--config.eval.knnlm_metric=l2")
  r = run_cli(*ext)
  line = _one_error_line(r)
  assert r.returncode == 2 and line.startswith(f"error: eval.knnlm_metric=l2: the datastore {ds} has no L2 index"), line
  assert "trime_jax.launch.build_datastore" in line and "--index_metric=l2" in line, line
  line = _one_error_line(run_cli(*build[:-1], "--index=none", "--index_metric=l2"))
  assert line == "error: --index_metric=l2 sets the metric of the index to build; --index=none builds none", line
  # the datastore's command rerun with its --overwrite would delete the datastore and its inner-product index
  line = _one_error_line(run_cli(*build, "--index_metric=l2", "--overwrite"))
  assert line == (f"error: --index_metric=l2 adds the L2 index to the datastore at --out={ds}; --overwrite would "
                  "remove that datastore (its keys and inner-product index) first: drop --overwrite"), line
  assert (ds / "index.faiss").exists() and (ds / "keys.npy").exists()
  r = run_cli(*build, "--index_metric=l2")
  assert r.returncode == 0, r.stderr[-3000:]
  assert json.loads((ds / "index_l2.faiss.json").read_text())["metric"] == "l2"
  assert json.loads((ds / "index.faiss.json").read_text())["metric"] == "inner_product"
  out = tmp / "ext_l2.json"
  r = run_cli(*ext, f"--output={out}")
  assert r.returncode == 0, r.stderr[-3000:]
  res = json.loads(out.read_text())
  assert res["knnlm_metric"] == "l2" and "kNN-LM by L2" in r.stdout
  assert {row["family"] for row in res["rows"]} >= {"trime", "knnlm", "knnlm_cache"}


def test_checkpoint_is_read_as_load_reads_a_path(trained, tmp_path):
  """--checkpoint takes what trime_jax.load takes: a training workdir (its export/) and a shipped model's
  name; one that does not exist is that one line even without --config (it used to be "--checkpoint needs
  --config" from eval and absl's "--config must have a value" from eval_ext and build_datastore)."""
  tmp, _, cfg, work = trained
  r = run_cli("trime_jax.launch.eval", f"--config={cfg}", f"--checkpoint={work}", "--config.eval.max_tokens=200")
  assert r.returncode == 0 and "| none" in r.stdout, r.stderr[-3000:]
  r = run_cli("trime_jax.launch.generate", "--checkpoint=demo", "--prompt=def f", "--max_new_tokens=3")
  assert r.returncode == 0 and "=== prompt 1" in r.stdout, r.stderr[-3000:]
  missing = tmp_path / "runs" / "nope" / "export"
  for module, extra in (("eval", ()), ("eval_ext", ()), ("build_datastore", (f"--out={tmp_path}/ds",))):
    line = _one_error_line(run_cli(f"trime_jax.launch.{module}", f"--checkpoint={missing}", *extra))
    assert line == f"error: checkpoint directory not found: {missing}", (module, line)
  line = _one_error_line(run_cli("trime_jax.launch.eval", "--checkpoint=demo2"))
  assert "'demo2' is neither a path nor a shipped model (shipped: demo)" in line
  assert not os.path.exists(tmp_path / "ds")
  # import_fairseq's --checkpoint is a .pt: a shipped model's name is not substituted there.
  (tmp_path / "dict.txt").write_text("hello 1\n")
  line = _one_error_line(run_cli("trime_jax.launch.import_fairseq", "--checkpoint=demo",
                                 f"--dict={tmp_path}/dict.txt", f"--out={tmp_path}/imported"))
  assert line == "error: fairseq checkpoint not found: demo"


def test_eval_ext_across_two_processes(trained):
  """`python -m trime_jax.distributed trime_jax.launch.eval_ext` on 2 processes × 2 CPU devices (gloo
  collectives): each process evaluates its 2 of the 4 streams on its devices and searches the datastore for its
  own queries; process 0 alone prints the table and writes --output, whose rows are one process's."""
  import subprocess
  import sys

  from tests.helpers import REPO, two_process_env

  tmp, _, cfg, work = trained
  ds = tmp / "ds_two"
  r = run_cli("trime_jax.launch.build_datastore", f"--config={cfg}", f"--checkpoint={work}/export", f"--out={ds}",
              "--index=flat")
  assert r.returncode == 0, r.stderr[-3000:]
  given = [f"--config={cfg}", f"--checkpoint={work}/export", f"--config.eval.datastore={ds}", "--config.eval.knn_k=16",
           "--config.eval.split=test", "--config.eval.batch_size=4", "--config.eval.devices=0"]
  r = run_cli("trime_jax.launch.eval_ext", *given, f"--output={tmp}/ext_one.json")
  assert r.returncode == 0, r.stderr[-3000:]
  env = two_process_env(2)
  procs = [subprocess.Popen([sys.executable, "-m", "trime_jax.distributed", "trime_jax.launch.eval_ext", *given,
                             f"--output={tmp}/ext_two.json"], cwd=REPO, env=dict(env, JAX_PROCESS_ID=str(i)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
  try:
    outs = [p.communicate(timeout=600) for p in procs]
  finally:  # a hung or failed run leaves no process behind
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  for p, (out, err) in zip(procs, outs):
    assert p.returncode == 0, "\n---\n".join(e[-3000:] for _, e in outs)
  # process 0 prints the table; process 1 prints nothing of ours (its stdout holds only gloo's own lines, written
  # by its C++ side, which may interleave)
  for printed in ("| family", "top-K retrieval accuracy", "external memory:"):
    assert printed in outs[0][0] and printed not in outs[1][0], (printed, outs[1][0][-2000:])
  one, two = (json.loads((tmp / f"ext_{n}.json").read_text()) for n in ("one", "two"))
  assert one["devices"] == 1 and two["devices"] == 2 and two["processes"] == 2 and "processes" not in one
  assert [r["variant"] for r in two["rows"]] == [r["variant"] for r in one["rows"]]
  for a, b in zip(one["rows"], two["rows"]):
    assert b["tokens"] == a["tokens"] > 0 and b["test_ppl"] == pytest.approx(a["test_ppl"], rel=1e-5), (a, b)
  for rank, acc in one["retrieval_accuracy"].items():  # a near-tie may round the other way on another mesh
    assert abs(two["retrieval_accuracy"][rank] - acc) <= 1 / one["rows"][0]["tokens"], (rank, acc, two)

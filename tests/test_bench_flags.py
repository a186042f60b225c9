"""The benchmarks' command lines refuse bad flags as the CLIs do: one `error:` line, exit status 2, before any
measurement (found by a walk-through: nonsense values printed negative MFU or a median of nothing with exit 0,
unknown configs and missing files ended in tracebacks, an existing --out of anything was overwritten, and a bad
--out failed only after the whole run)."""

import json

import pytest

from bench import common, eval_speed, generate, mfu, score_texts


def _refused(capsys, main, argv, said):
  with pytest.raises(SystemExit) as e:
    common.run(lambda: main(argv))
  err = capsys.readouterr().err.strip().splitlines()
  assert e.value.code == 2 and err and err[-1].startswith("error: ") and said in err[-1], (argv, err)


def test_bad_flags_are_one_error_line(tmp_path, capsys):
  precious = tmp_path / "notes.txt"
  precious.write_text("precious")
  for argv, said in [
      (["--tiny", "--steps=0"], "--steps must be >= 1, got 0"),
      (["--tiny", "--peak_tflops=-1"], "--peak_tflops must be >= 0"),
      (["--tiny", "--objectives=ce,xent"], "--objectives takes ce,trime"),
      (["--tiny", "--configs=nosuch"], "--configs: no config 'nosuch' (configs/nosuch.py)"),
      (["--tiny", "--configs=wiki103_7m", "--set", "model.nosuch=3"], "--set model.nosuch: no such config field"),
      # a value train.py's validation refuses (it reached the step as a NumPy traceback)
      (["--tiny", "--configs=wiki103_7m", "--set", "train.batch_size=-3"], "train.batch_size must be >= 1, got -3"),
      (["--tiny", "--configs=wiki103_7m", "--set", "model.remat=sometimes"], "model.remat"),
      (["--tiny", f"--out={tmp_path}"], "is a folder: give the JSON file to write"),
      (["--tiny", f"--out={tmp_path / 'no' / 'x.json'}"], "does not exist"),
      (["--tiny", f"--out={precious}"], "exists and is not a result of bench.mfu: pass --overwrite"),
  ]:
    _refused(capsys, mfu.main, argv, said)
  assert precious.read_text() == "precious"
  for argv, said in [(["--tiny", "--tokens=-5"], "--tokens must be >= 0"),
                     (["--tiny", "--line_len=0"], "--line_len must be >= 1"),
                     (["--tiny", "--configs=nosuch"], "no config 'nosuch'"),
                     (["--tiny", f"--out={precious}"], "is not a result of bench.eval_speed")]:
    _refused(capsys, eval_speed.main, argv, said)
  lines = tmp_path / "lines.txt"
  lines.write_text("a b c\n")
  for argv, said in [(["--texts=0"], "--texts must be >= 1, got 0"),
                     (["--repeats=0"], "--repeats must be >= 1"),
                     ([f"--text_file={tmp_path / 'none.txt'}"], "none.txt is not a file"),
                     ([f"--text_file={lines}", "--k=5"], "--datastore and --k are read with --memory=external only"),
                     ([f"--text_file={lines}", "--memory=external"], "datastore"),  # the API's ConfigError, one line
                     ([f"--text_file={lines}", "--model=nosuch"], "nosuch")]:
    _refused(capsys, score_texts.main, argv, said)
  for argv, said in [(["--batch=0"], "--batch sizes must be >= 1"), (["--batch=x"], "--batch takes batch sizes"),
                     (["--knn_k=0"], "--knn_k must be >= 1")]:
    _refused(capsys, generate.main, argv, said)


def test_out_of_a_benchmark_is_replaced_by_its_rerun(tmp_path):
  """An earlier result of the same benchmark is its rerun's to replace; another's is refused."""
  out = tmp_path / "mfu.json"
  out.write_text(json.dumps({"bench": "mfu", "configs": {}}))
  common.check_out(str(out), "mfu", overwrite=False)
  with pytest.raises(SystemExit):
    common.check_out(str(out), "eval_speed", overwrite=False)
  common.check_out(str(out), "eval_speed", overwrite=True)

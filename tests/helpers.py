"""Tiny configs and corpora that tests build themselves (no ../shared/data needed)."""

import json
import os
import subprocess
import sys
import textwrap

from trime_jax.configs import default

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WIKI_SAMPLE = """
 = Alpha Article =

 The alpha article is about alpha . Alpha is the first letter .
 Alpha appears again in the alpha article .

 = = Section = =

 More alpha text and some beta .
 = Beta Article =

 Beta is the second letter . The beta article mentions alpha once .

 = Gamma Article =

 Gamma gamma gamma , said the <unk> .
"""


def write_wikitext_dir(root, articles_per_split=None):
  """A WikiText-layout directory with wiki.{train,valid,test}.tokens built from WIKI_SAMPLE."""
  os.makedirs(root, exist_ok=True)
  for name in ("wiki.train.tokens", "wiki.valid.tokens", "wiki.test.tokens"):
    with open(os.path.join(root, name), "w") as f:
      f.write(WIKI_SAMPLE)
  return root


def write_text_file(path, n_bytes=60_000):
  """Real text (this repository's own Python sources) as a byte corpus."""
  chunks = []
  for dirpath, _, files in sorted(os.walk(os.path.join(REPO, "trime_jax"))):
    for fn in sorted(files):
      if fn.endswith(".py"):
        with open(os.path.join(dirpath, fn), "rb") as f:
          chunks.append(f.read())
  data = b"".join(chunks)
  while len(data) < n_bytes:
    data += data
  with open(path, "wb") as f:
    f.write(data[:n_bytes])
  return path


# A 3-update ext-memory run (drop-local draws, 2 micro-batches) that the 1-device, 8-device and 2-process
# training checks all make, so their metrics can be compared step for step.
TRAIN_MATCH = {"trime.memory": "ext", "trime.drop_local_prob": 0.5, "trime.ce_warmup_steps": 0,
               "train.batch_size": 16, "train.grad_accum": 2, "train.num_steps": 3, "data.segment_len": 16,
               "model.max_len": 16, "eval.block_len": 16, "eval.context_window": 8, "model.dropout": 0.0,
               "train.eval_max_tokens": 64, "eval.max_tokens": 64}
TRAIN_MATCH_CORPUS_BYTES = 30_000


def tiny_config(corpus_path, **overrides):
  """A byte-level config small enough for a few training steps in seconds."""
  c = default.get_config()
  c.data.corpus = "bytes"
  c.data.path = str(corpus_path)
  c.data.split_fractions = (0.8, 0.1, 0.1)
  c.data.segment_len = 32
  c.model.num_layers = 1
  c.model.d_model = 32
  c.model.num_heads = 2
  c.model.d_ff = 64
  c.model.max_len = 64
  c.model.dropout = 0.1
  c.train.batch_size = 4
  c.train.num_steps = 6
  c.train.learning_rate = 3e-3
  c.train.warmup_steps = 2
  c.train.log_every = 1
  c.train.checkpoint_every = 3
  c.train.eval_max_tokens = 300
  c.eval.block_len = 64
  c.eval.context_window = 32
  c.eval.batch_size = 4
  c.eval.max_tokens = 300
  for key, value in overrides.items():
    node = c
    *path, leaf = key.split(".")
    for p in path:
      node = node[p]
    node[leaf] = value
  return c


def config_file(tmp_path, corpus_path, **overrides):
  """A config .py file for the CLIs (launch/*.py) equivalent to tiny_config(corpus_path, **overrides)."""
  path = os.path.join(str(tmp_path), "tiny_config.py")
  with open(path, "w") as f:
    f.write(textwrap.dedent(f"""
        from tests.helpers import tiny_config

        def get_config():
          return tiny_config({str(corpus_path)!r}, **{overrides!r})
        """))
  return path


def two_process_env(devices_per_process: int, **extra) -> dict:
  """The environment of one process of a 2-process jax.distributed run on CPU (gloo collectives), without
  JAX_PROCESS_ID (each process adds its own): a free port for the coordinator, `devices_per_process` CPU devices."""
  import socket

  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  return dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu", JAX_NUM_PROCESSES="2",
              JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
              XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_per_process}", **extra)


def wikitext_dir(tmp_path, line=lambda i: " alpha beta gamma delta .\n", lines=lambda i: i + 1, articles=6):
  """A tiny corpus in WikiText's layout (tmp_path/wiki/wiki.{train,valid,test}.tokens, the same text in each):
  `articles` articles, article i holding `lines(i)` copies of `line(i)`."""
  data = tmp_path / "wiki"
  data.mkdir()
  text = "".join(f" = Article {i} = \n\n" + line(i) * lines(i) for i in range(articles))
  for name in ("wiki.train.tokens", "wiki.valid.tokens", "wiki.test.tokens"):
    (data / name).write_text(text)
  return data


def wikitext_config_file(tmp_path, data, extra: str = "") -> str:
  """tmp_path/cfg.py: default.py over the corpus at `data`, 8-token stream segments, 4 rows (`extra`: more
  `c.x = y` lines of get_config)."""
  cfg = tmp_path / "cfg.py"
  body = "".join(f"  {line.strip()}\n" for line in extra.strip().splitlines())
  cfg.write_text("from trime_jax.configs import default\n\n\ndef get_config():\n  c = default.get_config()\n"
                 f"  c.data.corpus, c.data.path = 'wikitext', {str(data)!r}\n"
                 "  c.data.segment_len, c.data.segmentation = 8, 'stream'\n  c.train.batch_size = 4\n"
                 f"{body}  return c\n")
  return str(cfg)


def run_cli(module, *args, timeout=300):
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=timeout)


def read_metrics(workdir) -> list:
  """The lines of `<workdir>/metrics.jsonl` as dicts."""
  with open(os.path.join(str(workdir), "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


def run_cli_cases(driver_module: str, cases: list, out_dir, timeout: int) -> list:
  """Run CLI cases in one driver subprocess (`python -m driver_module cases.json out_dir`, which writes
  results.json); [{rc, out, err, seconds}] in order. One persistent compilation cache per suite: later runs
  reuse the first run's compiled steps."""
  out_dir = str(out_dir)
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, "cases.json")
  with open(path, "w") as f:
    json.dump(cases, f)
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu",
             JAX_COMPILATION_CACHE_DIR=os.path.join(os.path.dirname(out_dir), "jax_cache"),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
  r = subprocess.run([sys.executable, "-m", driver_module, path, out_dir], cwd=REPO, env=env,
                     capture_output=True, text=True, timeout=timeout)
  assert r.returncode == 0, r.stderr[-3000:]
  with open(os.path.join(out_dir, "results.json")) as f:
    return json.load(f)


def grad_capture():
  """An optimizer whose state is the gradient it was given (no update): train_step's gradient, exactly."""
  import jax
  import jax.numpy as jnp
  import optax

  def init(params):
    return {"g": jax.tree_util.tree_map(jnp.zeros_like, params)}

  def update(grads, state, params=None):
    return jax.tree_util.tree_map(jnp.zeros_like, grads), {"g": grads}

  return optax.GradientTransformation(init, update)

"""Generate text from an exported checkpoint with TRIME's memory-augmented next-token distribution.

  python -m trime_jax.launch.generate --checkpoint=runs/demo/local/export --prompt="def main(argv):\\n" \\
      [--prompt=... | --prompt_file=FILE ...] [--max_new_tokens=64] [--temperature=0.8 --top_k=0 --top_p=0.95
      --seed=0 | --temperature=0 (greedy)] [--memory=none|local|long|external] [--tau=1.0] [--trace]

  --memory=none      the model's softmax alone (default for a model trained without memory, trime.memory=none)
  --memory=local     + the keys of the prompt and of everything generated so far (default otherwise)
  --memory=long      + a long-term store: --memory_file=FILE (its keys are computed first)
  --memory=external  + top-K entries of a datastore (--datastore=DIR from trime_jax.launch.build_datastore, --index,
                     --knn_k); --memory_file adds a store too; --knn_lambda / --tau_prime mix in Appendix A's P′;
                     --datastore_on_device: every entry, exactly, with the keys on the devices (no index)

τ (--tau) defaults to the export's eval.tau, --tau_prime and --interp_memory to its eval.tau_prime and
eval.interp_memory, --knn_k and --nprobe to its eval.knn_k and eval.nprobe, and retrieved entries are scored as
its evaluation scores them (eval.knn_exact: the index's scores, or exact from the stored keys); pass the values that trime_jax.launch.eval / trime_jax.launch.eval_ext tuned. `\\n` in --prompt is a newline. Several --prompt / --prompt_file are generated as one batch. --trace
prints, for each generated token, its probability, the share of it that came from memory and the three memories
that gave most (source, share, a few tokens of their context, [their next token]).
"""

import math

from absl import flags

from trime_jax.launch.checks import check_export
from trime_jax.launch.entry import run_main
from trime_jax.launch.flags import check_flag

_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Exported checkpoint directory (<workdir>/export).")
_PROMPT = flags.DEFINE_multi_string("prompt", [], "A prompt (repeat for a batch); \\n is a newline.")
_PROMPT_FILE = flags.DEFINE_multi_string("prompt_file", [], "A file whose whole text is one prompt (word models: "
                                         "final newlines dropped; repeatable).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Token budget per prompt (word models also stop at </s>).")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Sampling temperature; 0 = greedy.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Sample among the k most probable tokens (0: all).")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling: the most probable tokens with this much mass.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_MEMORY = flags.DEFINE_enum("memory", None, ["none", "local", "long", "external"],
                            "Memories of the distribution (default: none for a model trained without memory, else "
                            "local).")
_TAU = flags.DEFINE_float("tau", None, "τ on memory similarities g·k/√D (default: the export's eval.tau).")
_MEMORY_FILE = flags.DEFINE_string("memory_file", "", "Text file read into the long-term store first.")
_DATASTORE = flags.DEFINE_string("datastore", "", "Datastore directory (memory=external).")
_INDEX = flags.DEFINE_string("index", "", "FAISS index (default <datastore>/index.faiss).")
_KNN_K = flags.DEFINE_integer("knn_k", None, "Retrieved entries per generated token (default: the export's "
                              "eval.knn_k).")
_NPROBE = flags.DEFINE_integer("nprobe", None, "IVF lists searched (IVF-PQ indexes; default: the export's "
                               "eval.nprobe).")
_KNN_LAMBDA = flags.DEFINE_float("knn_lambda", 0.0, "Appendix A: (1-λ)·P_trime + λ·P′ (0: off).")
_TAU_PRIME = flags.DEFINE_float("tau_prime", None, "τ′ of P′ (on g·k/√D; default: the export's eval.tau_prime).")
_INTERP_MEMORY = flags.DEFINE_enum("interp_memory", None, ["external", "all"],
                                   "Memories of P′ (default: the export's eval.interp_memory).")
_ON_DEVICE = flags.DEFINE_bool("datastore_on_device", False, "memory=external: the datastore's keys on the devices, "
                               "every entry scored exactly (no FAISS index, no K; no trace or interpolation).")
_TRACE = flags.DEFINE_bool("trace", False, "Print a retrieval trace per generated token.")
_STOP_AT_EOS = flags.DEFINE_bool("stop_at_eos", True, "Stop a prompt at </s> (word vocabularies).")
flags.mark_flags_as_required(["checkpoint"])
# Ranges, checked when the flags are parsed (one `error:` line, before the model is loaded).
_finite = math.isfinite
check_flag(_MAX_NEW, lambda v: v >= 1, "an integer >= 1")
check_flag(_TEMPERATURE, lambda v: _finite(v) and v >= 0, "a number >= 0 (0: greedy)")
check_flag(_TOP_K, lambda v: v >= 0, "an integer >= 0 (0: every token)")
check_flag(_TOP_P, lambda v: 0 < v <= 1, "in (0, 1]")
check_flag(_TAU, lambda v: _finite(v) and v > 0, "a number > 0")
check_flag(_KNN_K, lambda v: v >= 1, "an integer >= 1")
check_flag(_NPROBE, lambda v: v >= 1, "an integer >= 1 (IVF lists searched per query)")
check_flag(_KNN_LAMBDA, lambda v: 0 <= v < 1, "in [0, 1) (0: no interpolation)")
check_flag(_TAU_PRIME, lambda v: _finite(v) and v > 0, "a number > 0")


def main(argv):
  del argv
  from trime_jax import generate as G
  from trime_jax.errors import ConfigError

  prompts = [p.replace("\\n", "\n") for p in _PROMPT.value]
  files = []
  for path in _PROMPT_FILE.value:
    try:
      with open(path, encoding="utf-8") as f:
        files.append(f.read())
    except (OSError, UnicodeDecodeError) as e:
      raise ConfigError(f"--prompt_file {path}: {e}") from None
  if not prompts and not files:
    raise ConfigError("nothing to continue: give --prompt or --prompt_file")
  memory = _MEMORY.value
  named = memory or "the default memory (none or local)"
  if _MEMORY_FILE.value and memory not in ("long", "external"):
    raise ConfigError(f"--memory_file fills the long-term store: use --memory=long (or external), not {named}")
  if memory == "long" and not _MEMORY_FILE.value:
    raise ConfigError("--memory=long needs --memory_file (the text the store holds)")
  if _DATASTORE.value and memory != "external":
    raise ConfigError(f"--datastore is read with --memory=external, not {named}")
  if memory == "external" and not _DATASTORE.value:
    raise ConfigError("--memory=external needs --datastore (build one with `python -m trime_jax.launch.build_datastore`)")
  if _ON_DEVICE.value and memory != "external":
    raise ConfigError(f"--datastore_on_device puts --datastore on the devices: use --memory=external, not {named}")
  # A setting the chosen memory would not read is refused, not ignored (as the Python API refuses it): retrieval
  # without external memory, P′'s settings without the interpolation that uses them. --index when on; --knn_k /
  # --nprobe when given at all (their defaults come from the export).
  retrieval = [f"--{f.name}" for f in (_INDEX,) if f.value] + [
      f"--{f.name}" for f in (_KNN_K, _NPROBE) if f.value is not None]
  if retrieval and memory != "external":
    raise ConfigError(f"{', '.join(retrieval)} {'sets' if len(retrieval) == 1 else 'set'} retrieval from "
                      f"--datastore, which --memory=external reads; "
                      + (f"--memory={memory}" if memory else named) + " retrieves nothing")
  p_prime = [f"--{f.name}" for f in (_TAU_PRIME, _INTERP_MEMORY) if f.value is not None]
  if p_prime and not _KNN_LAMBDA.value:
    raise ConfigError(f"{', '.join(p_prime)} {'sets' if len(p_prime) == 1 else 'set'} Appendix A's P′, which "
                      "only --knn_lambda > 0 mixes in (with --memory=external)")
  # and --trace / --knn_lambda when on (--notrace, --knn_lambda=0 ask for nothing)
  given = [f"--{f.name}" for f in (_TRACE, _KNN_LAMBDA) if f.value] + retrieval
  if _ON_DEVICE.value and given:
    # Refused before the keys are loaded (a 17.8M-key datastore takes minutes), not after; a retrieval setting
    # given with it would otherwise be silently unused.
    raise ConfigError(f"--datastore_on_device gives exact sums over every entry, not retrieved entries: "
                      f"{', '.join(given)} {'needs' if len(given) == 1 else 'need'} a FAISS index (drop "
                      "--datastore_on_device)")

  check_export(None, _CHECKPOINT.value)  # a config.json field this version does not know: refused
  gen = G.Generator(_CHECKPOINT.value)
  memory = memory or gen.default_memory
  if _TAU.value is not None and memory == "none":
    raise ConfigError("--tau is the temperature on memory similarities; --memory=none uses no memory"
                      + ("" if _MEMORY.value else " (the default for this export, trained without memory)"))
  # A word model's file: its final newline would end the line (</s>) to continue; bytes are the text itself
  prompts += [t.rstrip("\n") if gen.vocab.kind == "words" else t for t in files]
  gen.prompt_ids(prompts)  # an empty prompt is refused before the memories load and the settings line is printed
  tau = gen.default_tau if _TAU.value is None else _TAU.value
  if _TAU.value is None and not (math.isfinite(tau) and tau > 0):
    # The export's own evaluation τ is broken: say so, not "--tau must be > 0" for a flag nobody passed.
    raise ConfigError(f"{_CHECKPOINT.value}/config.json has eval.tau={tau!r}, not a τ (> 0) to "
                      "generate with: pass --tau (e.g. the τ trime_jax.launch.eval tuned) or correct the file")
  # P′'s settings default to the export's evaluation ones, as τ does (a 247M export's tuned τ′ is 0.328, not 1)
  e = gen.config.eval
  tau_prime = float(e.get("tau_prime", 1.0)) if _TAU_PRIME.value is None else _TAU_PRIME.value
  interp_memory = str(e.get("interp_memory", "external")) if _INTERP_MEMORY.value is None else _INTERP_MEMORY.value
  spec = G.MemorySpec(memory, tau=tau, knn_lambda=_KNN_LAMBDA.value, tau_prime=tau_prime,
                      interp_memory=interp_memory)
  sampling = G.Sampling(_TEMPERATURE.value, _TOP_K.value, _TOP_P.value, _SEED.value)
  store = external = None
  if _MEMORY_FILE.value:
    try:
      with open(_MEMORY_FILE.value, encoding="utf-8") as f:
        text = f.read()
    except (OSError, UnicodeDecodeError) as e:
      raise ConfigError(f"--memory_file {_MEMORY_FILE.value}: {e}") from None
    store = gen.new_store()
    n = gen.read(store, text)
    print(f"long-term memory: {n:,} tokens of {_MEMORY_FILE.value}", flush=True)
  if memory == "external" and _ON_DEVICE.value:
    external = gen.on_device(_DATASTORE.value)
    print(f"external memory: all {external.count:,} entries, exact, on {external.devices} device(s)", flush=True)
  elif memory == "external":
    # k / nprobe: the flags, else (None) the export's, as exactness and the GPU index (G.retrieval_settings)
    external = gen.external(_DATASTORE.value, index_path=_INDEX.value, k=_KNN_K.value, nprobe=_NPROBE.value)
    print(f"external memory: top-{external.k} of {external.datastore.count:,} entries ({external.index.kind})",
          flush=True)
  mixed = f" knn_lambda={spec.knn_lambda:g} tau_prime={tau_prime:g} interp_memory={interp_memory}" \
      if spec.knn_lambda else ""
  print(f"memory={memory} tau={tau:g}{mixed} temperature={sampling.temperature:g} top_k={sampling.top_k} "
        f"top_p={sampling.top_p:g} seed={sampling.seed}", flush=True)
  outs = gen.generate(prompts, max_new_tokens=_MAX_NEW.value, sampling=sampling, memory=spec, store=store,
                      external=external, trace=_TRACE.value, stop_at_eos=_STOP_AT_EOS.value)
  for i, out in enumerate(outs):
    print(f"\n=== prompt {i + 1} ({len(out.tokens)} tokens, stopped at {out.stopped}) ===")
    print(out.prompt + "\u2502" + out.text)  # │ marks where the continuation starts (its own space before it)
    if _TRACE.value:
      print(f"--- retrieval trace (τ={tau:g}): token, P(token), share from memory <- top memories "
            "(source share ...context[next token]) ---")
      for step in out.trace:
        print(step.format())


if __name__ == "__main__":
  run_main(main, interrupted="nothing was printed (the texts are printed when every prompt is done): rerun with "
                             "fewer --max_new_tokens")

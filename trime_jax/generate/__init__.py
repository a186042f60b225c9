"""Autoregressive generation from an export, with TRIME's memory-augmented distribution as the next-token law.

    P(w | c) ∝ exp(logit_w) + Σ_{memories j with x_j = w} exp(g(c) · k_j / √D / τ)

computed by `scoring.memory_log_probs` (the dense segment-sum) for one query per row and step. The memories are
(key, next token) pairs, exactly as evaluation lays them out (`evaluate.memory`):

  none       the model's softmax alone
  local      the keys of the prompt and of every token generated so far, per row (each keyed once, in the
             window that fed it: evaluation's local memory + its unbounded long-term store)
  long       local + a `LongTermMemory` carried across calls (a document, a chat history: `read` fills it,
             every call appends its prompts and outputs unless remember=False), shared by all rows
  external   local (+ the long-term store if given) + the top-K entries a FAISS index retrieves from a
             `trime_jax.launch.build_datastore` datastore, one search per generated token; their similarities are
             evaluation's (`eval.knn_exact`): the index's own (IVF-PQ: approximate) scores, or with exact=True
             re-scored from the stored keys. Optionally Appendix A's interpolation
             (1 - λ)·P_trime(τ) + λ·P′(τ′), P′(w) ∝ Σ_{retrieved, x_j = w} exp(sim / τ′).
             Or every entry of the datastore, exactly, when it is on the devices (`Generator.on_device`,
             `exact_memory.exact_external_log_probs`: no search, no K; no interpolation or trace of its entries)

The model runs over a key/value cache (`TransformerLM.decode`): one prefill of the prompts (right-padded,
rows of different lengths), then one token per step. Sequences start with `vocab.bos`, as every evaluated
stream does. The context is a sliding window: when a row's window would pass max_len tokens, it restarts
from its last `keep` tokens (re-encoded; default max_len // 2), so every token is predicted from between
`keep` and max_len tokens; memory keys already computed stay. A prompt longer than max_len is keyed with
evaluation's windows (block max_len, context `keep`) and generation starts from its last `keep` tokens.

Sampling: temperature (0 = greedy), then top-k (ties at the k-th value kept), then top-p (the smallest set
of most probable tokens whose mass reaches p, ties kept), a key per (seed, row, step): a row's samples do
not depend on its batch's other rows' contents, only on its index.

The pieces, one file each (every public name is re-exported here: `generate.X`):

  sampling.py   `Sampling` and the pure sampling functions (`filter_log_probs`, `sample`, `row_keys`)
  memory.py     `MemorySpec`; `LongTermMemory` (carried across calls); `Memories`, one call's memories: the local
                slots of every row, the padded long-term store, the entries retrieved each step
  decoder.py    `CachedDecoder`: the model over its key/value cache (prefill, one token per step) and the jitted
                next-token step (`next_token_log_probs`, the law; sampling; the new key remembered); the keys of a
                text in evaluation's windows
  text.py       `Text`: prompts <-> token ids (bytes or WikiText-style words)
  trace.py      the retrieval trace (`TraceStep`, `TraceMemory`): which memories gave the sampled token its mass
  generator.py  `Generator`, the façade: loads the export (or takes a caller's loaded one), wires the pieces, runs
                the loop; `Generation`; `retrieval_settings`, how an export's datastore is searched by default
"""

from trime_jax.generate.decoder import CachedDecoder, next_token_log_probs
from trime_jax.generate.generator import Generation, Generator, retrieval_settings
from trime_jax.generate.memory import (INTERP_MEMORIES, MEMORIES, STORE_BLOCK, LongTermMemory, Memories,
                                       MemorySpec)
from trime_jax.generate.sampling import Sampling, filter_log_probs, row_keys, sample
from trime_jax.generate.text import Text
from trime_jax.generate.trace import TRACE_CONTEXT, TraceMemory, TraceStep

__all__ = ["CachedDecoder", "Generation", "Generator", "INTERP_MEMORIES", "LongTermMemory", "MEMORIES", "Memories",
           "MemorySpec", "STORE_BLOCK", "Sampling", "TRACE_CONTEXT", "Text", "TraceMemory", "TraceStep",
           "filter_log_probs", "next_token_log_probs", "retrieval_settings", "row_keys", "sample"]

"""Test time: every memory through one scorer, one driver and one tuner.

  points.py  the families as typed `Point`s, the tuning grids, `point_nlls` (every point from the memory
             blocks, on `scoring`), `tune`
  memory.py  the memory blocks (local, long-term `StoreSpec`, external) and the stream plan
  driver.py  the jitted forward / scoring steps and `evaluate` (one pass over a corpus)
  runner.py  `evaluate_checkpoint` (trime_jax.launch.eval, eval_ext, demo) and `format_table`

Every public name is importable from the package (`from trime_jax import evaluate; evaluate.evaluate(...)`).

The split is one token stream (documents concatenated, as fairseq's `eval_lm`), cut into windows
(`data.windows`): chunks of S = block_len - context_window scored targets, each fed with up to
`context_window` earlier tokens as context only. Every target is scored exactly once.

A scored token's test memory is data layout, as in training: three sources of (key, next token) pairs, each
with `scoring.TokenMeta` for its queries and memories, and `scoring.visible` deciding who sees whom:
  local       the window's earlier tokens (context included): causal within the window
  long-term   earlier scored tokens (`long_memory.Store`), each keyed in the window that scored it, in one of
              two layouts (`StoreSpec.layout`, config eval.long_term_layout):
                original  the release's: the last `mem_size` scored tokens before the window's first scored
                          token, so the window's context tokens are in the store AND in the local memory (with
                          different keys); the original's --mem-size M is mem_size = M
                disjoint  ours: the `mem_size` tokens before the window's start, so every token counts once
                          (= the original's M when mem_size = M - context_window, apart from the duplicates)
              and of the query's document only with `reset_at_documents=True` (the original never resets)
  external    the top-K entries retrieved from a datastore (`knn.ExternalMemory`, one search per scored
              token): rows of their own (row -1), visible like training's other rows
A family's memory is a union of these blocks, and every family (`points.FAMILIES`: none, cache, trime_local,
trime, interp, knnlm, knnlm_cache) comes out of one pass (a grid over τ, τ′, λ, θ costs one pass, not one
per point).

sim = g(c)·g(c_j)/√D throughout (but for the kNN-LM families under eval.knnlm_metric="l2", the original's
kNN-LM: their entries from an L2 index and every memory of theirs at sim = -|g(c) - g(c_j)|²);
p_mem(θ)(w) ∝ Σ_{x_j = w} exp(θ·sim). Where a query has no memory at all the
mixtures fall back to the model (P_trime or p_LM). The original's --interp-temp has no √D (its P′ is
softmax(g·k_j / τ′_orig) over the top-K): τ′_orig = √D·τ′ (D = 1,024: its 10.5 is our τ′ = 0.328).

The original layout reproduces the release's scores token by token (tests/test_oracle.py); the disjoint
layout differs from it only by the duplicated context tokens (docs/long_memory.md, "Two store layouts").

The driver runs `streams` parallel streams over a stream plan (`data.stream_schedule`): the windows split into
contiguous runs, one per stream, each with its own long-term store; a stream first re-runs (without scoring)
the windows whose tokens its store needs. One step = the forward pass (jitted), the search (host), the
scoring of every point (jitted). No memory, local, long-term and external memory all take this path. One
stream can keep the state its first windows left and a later pass start there (`StreamState`: the Python API
runs its memory documents' windows once for every text scored after them). Many independent texts share one
pass through `texts_plan` (each text a corpus of its own, whole texts per row, rows as long as the texts need:
the Python API's scoring of a list of texts, with local memory, or with a long-term store of each text's own
earlier tokens).
"""

from trime_jax.evaluate.points import (DISPLAY_NAMES, EVAL_MEMORIES, EXTERNAL_FAMILIES, FAMILIES, FAMILY_PARAMS,
                                       GRIDS, INTERP_MEMORIES, LAMBDA_GRID, NONE, TAU_GRID, TAU_PRIME_GRID,
                                       THETA_GRID, Point, configured_points, exact_scales, families_of, grid,
                                       grid_edges, point_nlls, tune, nll_improves)
from trime_jax.evaluate.memory import (LONG_TERM_LAYOUTS, MEM_SIZE_AXIS_LABELS, QueryStats, StoreSpec, StreamPlan,
                                       external_block, l2_block, local_block, long_term_block, mem_size_axis_label,
                                       row_length, stream_plan, text_windows, texts_plan)
from trime_jax.evaluate.driver import (EvalResult, ProgressLog, Score, StreamState, evaluate, forward_queries,
                                       score_step)
from trime_jax.evaluate.runner import (evaluate_checkpoint, format_table, knnlm_metric_of, load_eval_data,
                                       on_device_datastore, search_queries_of)
from trime_jax.scoring import MemoryBlock

__all__ = [
    "DISPLAY_NAMES", "EVAL_MEMORIES", "EXTERNAL_FAMILIES", "FAMILIES", "FAMILY_PARAMS", "GRIDS", "INTERP_MEMORIES",
    "LAMBDA_GRID", "NONE", "TAU_GRID", "TAU_PRIME_GRID", "THETA_GRID", "Point", "configured_points", "exact_scales",
    "families_of", "grid", "grid_edges", "point_nlls", "tune", "LONG_TERM_LAYOUTS", "MEM_SIZE_AXIS_LABELS",
    "QueryStats",
    "StoreSpec", "StreamPlan", "external_block", "l2_block", "local_block", "long_term_block", "mem_size_axis_label",
    "row_length", "stream_plan", "text_windows", "texts_plan", "EvalResult", "ProgressLog", "Score", "StreamState", "evaluate", "forward_queries",
    "score_step",
    "evaluate_checkpoint", "format_table", "knnlm_metric_of", "load_eval_data", "on_device_datastore",
    "search_queries_of",
    "MemoryBlock",
]

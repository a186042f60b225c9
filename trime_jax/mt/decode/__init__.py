"""Decoding for translation, one job per module (every public name re-exported: `decode.X`):

  beam.py           greedy and beam search over a next-token callback (fairseq's SequenceGenerator semantics):
                    SearchOptions, EVAL_SEARCH, Hypothesis, beam_search, greedy, search (plain NumPy; not named
                    search.py: the package's `search` is the function, which would hide a submodule so named)
  distributions.py  the next-token laws over retrieved entries, from the LM's scorer: trime_log_probs
                    (TrimeMT_ext, Appendix A's interpolation), release_trime_log_probs (TrimeMT_ext as the
                    release's decoder combines them), knn_mt_log_probs (kNN-MT), Distribution (which law)
  retrieval.py      the top-K datastore entries of decoder queries by exact inner product or L2: Neighbours,
                    retrieve
  translator.py     Translator: an MT export's cached decoder + search + a Distribution (+ a datastore)
  tuning.py         one teacher-forced pass over valid (tune_pass) and every K / τ / λ / T read from it (tune)

The arrows point down this list's dependencies: translator uses beam, distributions and retrieval; tuning
uses distributions and retrieval (and `evaluate`'s public points); beam knows no model.
"""

from trime_jax.mt.decode.beam import EVAL_SEARCH, Hypothesis, NextLogProbs, SearchOptions, beam_search, greedy, search
from trime_jax.mt.decode.distributions import (MODES, Distribution, knn_mt_log_probs, l2_as_inner_product,
                                               release_trime_log_probs, trime_log_probs)
from trime_jax.mt.decode.retrieval import Neighbours, retrieve
from trime_jax.mt.decode.translator import Translator
from trime_jax.mt.decode.tuning import KNN_T_GRID, KS, TunePass, tune, tune_pass

__all__ = ["MODES", "Distribution", "knn_mt_log_probs", "l2_as_inner_product", "release_trime_log_probs",
           "trime_log_probs", "Neighbours", "retrieve", "EVAL_SEARCH", "Hypothesis", "NextLogProbs", "SearchOptions", "beam_search",
           "greedy", "search", "Translator", "KNN_T_GRID", "KS", "TunePass", "tune", "tune_pass"]

"""Tokens an epoch of translation batches costs under each composition of an update (counted, not timed).

ours (data.batches_per_update=0): the order cut once into data.max_tokens-token batches at bucketed shapes;
the original's (G > 0): G fairseq batch_by_size batches of max_tokens / G tokens an update, laid out as G row
blocks (mt/batching.py). Each padded, and packed (data.pack_len); the original's GPUs' own padding (each batch
to its own longest pair) beside them. ui-de-en's training pairs (docs/machine_translation.md's table):

  python -m bench.mt_composition [--max_tokens=16384 --per_update=4 --pack_len=128 --seed=1]
"""

import argparse
import collections

from trime_jax.configs import ui_de_en
from trime_jax.mt import batching
from trime_jax.mt import data as mt_data


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--max_tokens", type=int, default=16384, help="padded tokens an update (data.max_tokens)")
  ap.add_argument("--per_update", type=int, default=4, help="the original's GPU batches an update")
  ap.add_argument("--pack_len", type=int, default=128)
  ap.add_argument("--seed", type=int, default=1)
  args = ap.parse_args()
  c = ui_de_en.get_config()
  mt_data.resolve_data_path(c)
  pairs = mt_data.load_parallel(c, "train", mt_data.load_vocab(c))
  print(f"{len(pairs):,} training pairs")
  for order in ("random", "bm25", "length"):
    for per_update in (0, args.per_update):
      plan = batching.make_plan(pairs, order=order, max_tokens=args.max_tokens, seed=args.seed,
                                batches_per_update=per_update, bm25_backend="numba")
      counts = {}
      for pack in (0, args.pack_len):  # the first epoch's updates
        shapes = collections.Counter(batching.collate_update(pairs, plan, s, pack_len=pack)["targets"].shape
                                     for s in range(plan.num_updates))
        counts[pack] = (sum(r * l * n for (r, l), n in shapes.items()), len(shapes))
      h = plan.header
      print(f"{order:6} {'ours' if not per_update else f'G={per_update}':5} | {plan.num_updates:,} updates | "
            f"{len(pairs) / plan.num_updates:.0f} pairs/update | padded {counts[0][0]:,} ({counts[0][1]} shapes) | "
            f"packed {counts[args.pack_len][0]:,} ({counts[args.pack_len][1]} shapes) | real {h['real_tokens']:,}"
            + (f" | the original's GPUs pad {h['original_padded_tokens']:,}" if per_update else ""), flush=True)


if __name__ == "__main__":
  main()

"""Machine translation with TRIME (paper §5): an encoder–decoder Transformer trained with external in-batch
memory over target tokens (TrimeMT_ext). model: the network; data: subword vocabulary and parallel text;
batching: token-budget and BM25 batches of sentence pairs; train: the training loop."""

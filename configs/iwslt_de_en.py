"""The paper's MT setting (§5): IWSLT'14 De→En, fairseq `transformer_iwslt_de_en`, as the original TrimeMT run.

Data: fairseq's examples/translation/prepare-iwslt14.sh output (`iwslt14.tokenized.de-en/{train,valid,test}.{de,en}`,
tokenised, BPE'd with `@@ `): data.format=fairseq, the vocabulary is those BPE tokens, one dictionary per side
as fairseq's preprocess built them (data.dictionaries="separate": the decoder's input and softmax hold the
English tokens only).

The original command (princeton-nlp/TRIME machine_translation/README.md):
  train.py data-bin/iwslt14.tokenized.de-en --arch transformer_iwslt_de_en --share-decoder-input-output-embed
    --decoder-normalize-before --optimizer adam --adam-betas "(0.9, 0.98)" --clip-norm 0.0 --lr 5e-4
    --lr-scheduler inverse_sqrt --warmup-updates 4000 --ce-warmup-epoch 5 --dropout 0.3 --weight-decay 0.0001
    --criterion trime_mt_loss --label-smoothing 0.0 --max-tokens 4096 --predefined-batches bm25_batches.json
    --max-epoch 50 --dist-func ip --temp 10.0 --topk-mem 8          (4 GPUs: 4 × 4096 tokens per update)
Vanilla baseline: the README names only --criterion label_smoothed_cross_entropy (ε 0.1 as fairseq's IWSLT
example); read as the same 4-GPU command without --predefined-batches: --config.trime.memory=none
--config.train.label_smoothing=0.1 --config.trime.batching=length (fairseq's length-sorted batches, composed as
the original's iterator does; their 4 GPU batches have unrelated lengths, so the G-block layout pads ~7x what
the original does: data.pack_len, at least data.max_len, removes that padding).
Read as the original's code runs it:
- --ce-warmup-epoch 5 never takes effect: its fairseq_cli/train.py sets the criterion's return_ce_loss per epoch,
  then again before every batch from --ce-warmup-ratio, which the command does not give (default None: TRIME loss).
  So TrimeMT trains with trime_mt_loss from update 1: trime.ce_warmup_steps=0.
- The run's length is --max-epoch 50 with no --max-update: train.num_epochs=50 passes over the plan's batches
  (their number per epoch depends on the data: groups of 4 GPU batches). The paper's table states 170,000
  updates instead; train.num_steps=170_000 caps the run there.
- An update is 4 GPU batches: fairseq's batch_by_size cuts the BM25 chain into batches of about 4,096 padded
  tokens (sizes a multiple of 8, each padded to its own longest pair), 4 consecutive ones an update, and each
  epoch shuffles the groups of 4 (its iterator with --predefined-batches; without, as the vanilla baseline's
  length batches, every batch one by one): data.batches_per_update=4.
- Its 4 GPUs all_gather their keys: a key gets gradient only from queries of its own GPU's batch.
  trime.memory_grad="local_only" does the same on 4 devices, trime.memory_grad_groups=4 on one (the update's 4
  row blocks, which are the 4 GPU batches).
The original's key (knn_embed) is the decoder output: model.key_type="final" below.
"""

from trime_jax.configs import ui_de_en


def get_config():
  c = ui_de_en.get_config()
  c.unlock()
  c.data.format = "fairseq"
  c.data.dictionaries = "separate"  # the original's preprocess (no --joined-dictionary): a dictionary per side
  c.data.path = "iwslt14.tokenized.de-en"
  c.data.cache_dir = ""
  c.data.max_len = 1024  # fairseq max_source/target_positions
  c.data.max_tokens = 4096 * 4  # 4 GPUs × --max-tokens 4096 per update
  c.data.batches_per_update = 4  # as the original composes an update: 4 batch_by_size batches of 4,096 tokens
  c.model.update(d_model=512, num_heads=4, d_ff=1024, encoder_layers=6, decoder_layers=6, dropout=0.3,
                 share_all_embeddings=False, share_decoder_embeddings=True, encoder_normalize_before=False,
                 decoder_normalize_before=True, key_type="final")
  c.trime.update(memory="ext", batching="bm25", tau=10.0, memory_topk=8, ce_warmup_steps=0,
                 memory_grad="local_only", memory_grad_groups=4)
  # warmup_init_lr 0: the command gives no --warmup-init-lr, and fairseq's inverse_sqrt then warms up from 0
  c.train.update(seed=1,  # fairseq's --seed default: the epochs' shuffles of the update groups are the original's
                 num_steps=170_000, num_epochs=50, learning_rate=5e-4, warmup_steps=4000, warmup_init_lr=0.0,
                 weight_decay=1e-4, adam_b2=0.98, label_smoothing=0.0, eval_every=1000, checkpoint_every=1000, eval_max_pairs=0,
                 # checkpoint_best.pt by valid BLEU: --eval-bleu --eval-bleu-args '{"beam": 5, "max_len_a": 1.2,
                 # "max_len_b": 10}' --eval-bleu-detok moses --eval-bleu-remove-bpe --best-checkpoint-metric bleu
                 best_metric="bleu")
  c.lock()
  return c

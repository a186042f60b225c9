"""A CPU-sized TrimeMT / vanilla Transformer for ui-de-en (German→English UI strings, ../shared/data/ui-de-en).

  python -m trime_jax.launch.train_mt --config=configs/ui_de_en.py --workdir=runs/ui_vanilla                 # vanilla
  python -m trime_jax.launch.train_mt --config=configs/ui_de_en.py --config.trime.memory=ext \\
      --config.trime.batching=bm25 --workdir=runs/ui_trime_bm25                                    # TrimeMT_ext
  ... --config.trime.memory=ext --config.trime.batching=random                                     # random batches

3+3 layers, d 256, FFN 1024, 4 heads, an 8k joint sentencepiece vocabulary trained on train.de + train.en.
Every MT config field is listed here (the MT config is its own schema, not configs/default.py's).
"""

import ml_collections


def get_config():
  c = ml_collections.ConfigDict()

  c.data = d = ml_collections.ConfigDict()
  d.format = "text"  # text (aligned raw files + project sentencepiece) | fairseq (prepare-iwslt14.sh output, BPE)
  d.dictionaries = "joint"  # format fairseq: joint (ours: one dictionary of both sides' BPE tokens) | separate
  #   (fairseq's preprocess without --joined-dictionary: the decoder's input and softmax hold the target side's
  #   tokens only, padded to a multiple of 8; a token outside its side's dictionary is <unk>)
  d.path = "../shared/data/ui-de-en"  # relative paths: from the working directory, else the repository root
  d.src_lang = "de"
  d.tgt_lang = "en"
  d.vocab_size = 8000  # joint sentencepiece vocabulary (format=text)
  d.spm_model_type = "unigram"  # sentencepiece model type: unigram | bpe
  d.cache_dir = "runs/cache/ui_de_en"  # sentencepiece model cache, keyed by text digest + options (git-ignored)
  d.max_len = 128  # training pairs longer than this (model tokens, ids + eos) are dropped; valid/test truncated
  d.max_tokens = 4096  # padded tokens per batch: rows · L <= max_tokens (fairseq --max-tokens)
  d.max_sentences = 0  # cap on rows per batch (fairseq --batch-size); 0 = none
  d.batches_per_update = 0  # 0 (ours): an update is one cut of max_tokens padded tokens at a bucketed shape. G > 0
  #   (the original's): G batches of max_tokens / G tokens an update, one a GPU, cut by fairseq's batch_by_size,
  #   each padded to its own longest pair, and its iterator's epoch shuffles (mt/batching.py)
  d.batch_size_multiple = 8  # with batches_per_update: batch sizes a multiple of this (--required-batch-size-multiple)
  d.pack_len = 0  # > 0: a batch's pairs packed into rows of this many tokens (attention and positions per pair,
  #   the loss's rows = pairs): the same sets of pairs and the same objective with little padding (ours; the
  #   original pads every pair to the batch's longest). BM25 / random batches mix lengths: ~3x fewer tokens

  c.model = m = ml_collections.ConfigDict()
  m.d_model = 256
  m.num_heads = 4
  m.d_ff = 1024
  m.encoder_layers = 3
  m.decoder_layers = 3
  m.dropout = 0.1  # ~1.5 epochs (experiments/ui_de_en.sh): light regularisation (the paper's 50-epoch IWSLT run: 0.3)
  m.attention_dropout = 0.0
  m.activation_dropout = 0.0
  m.max_len = 1024  # positions table; batches are bucketed to <= data.max_len's bucket
  m.pad_id = 0
  m.share_decoder_embeddings = True  # fairseq --share-decoder-input-output-embed
  m.share_all_embeddings = True  # joint vocabulary: one embedding for source, target and output
  m.encoder_normalize_before = False
  m.decoder_normalize_before = True  # the original TrimeMT run: --decoder-normalize-before
  m.position_offset = 2
  m.key_type = "final"  # g: final (the original MT code's knn_embed: the decoder output) | last_ffn_input (as the LM)
  m.dtype = "float32"

  c.trime = t = ml_collections.ConfigDict()
  t.memory = "none"  # none (vanilla, CE) | ext (TrimeMT_ext: every target token of the other pairs in the batch)
  t.batching = "length"  # length (fairseq) | bm25 (Algorithm 1 over target sentences) | random
  t.bm25_k = 20  # hits per target sentence, its own among them (Algorithm 1's k; hits[1:] followed)
  t.bm25_k1, t.bm25_b = 0.9, 0.4  # BM25 scoring: the original's (Pyserini's LuceneSearcher defaults)
  t.bm25_analyzer = "english"  # english: each target sentence's words through Lucene's English analysis, searched
  #   as the original's Pyserini (batching/lucene.py; plans of before 2026-12-08 searched subword ids) | none: ids
  t.bm25_backend = "numba"  # bm25s backend: numba (fast; ~20 s JIT compile once) | numpy (no compile, slower)
  t.tau = 10.0  # τ on memory similarities g·g_j/√D (the original MT run's --temp 10)
  t.memory_topk = 8  # only the 8 most similar in-batch memories per target token (the original's --topk-mem 8;
  #   0 = every visible memory)
  t.stop_gradient_memory = False
  t.ce_warmup_steps = 0  # plain-CE updates before the TRIME loss (the original's command passes --ce-warmup-epoch
  #   5, which its train.py never applies: configs/iwslt_de_en.py; experiments/ui_de_en.sh sets a tenth of each run)
  t.memory_chunk = 0  # blockwise loss chunk (0: derived from the 64 MiB block budget)
  t.consecutive_segments = 1  # unused for MT (ObjectiveSpec field)
  t.sharded_variant = "gather"  # >1 device: gather | ring (trime_jax/sharded_loss.py; memory_topk needs gather)
  t.memory_grad = "all"  # >1 device: all (every memory key gets its gradient) | local_only (the original's
  #   all_gather: keys get gradient from queries on their own device only)
  t.memory_grad_groups = 0  # one device: > 0 splits a batch's rows into this many contiguous groups, a key's
  #   gradient from its own group's queries only (the original's GPUs, each all_gathering the others' keys
  #   without gradient); values unchanged. 0: every query reaches every key

  c.train = r = ml_collections.ConfigDict()
  r.seed = 0
  r.num_steps = 1200  # updates (an upper bound when target_token_budget or num_epochs is set)
  r.num_epochs = 0  # > 0: stop after this many passes over the plan's batches, or at num_steps if that comes first
  #   (fairseq's --max-epoch beside --max-update)
  r.target_token_budget = 0  # > 0: stop at the first update after which this many target tokens were trained on
  #   (equal budgets across objectives whose batches pad differently); 0 = train.num_steps updates
  r.optimizer = "adam"
  r.learning_rate = 1e-3  # short budget: the 1M-token runs at 5e-4 / dropout 0.3 stopped at valid perplexity ~260
  r.adam_b1 = 0.9
  r.adam_b2 = 0.98
  r.adam_eps = 1e-8
  r.weight_decay = 1e-4
  r.nag_momentum = 0.99
  r.schedule = "inverse_sqrt"
  r.warmup_steps = 200  # linear warm-up; short, so that vanilla (~700 updates at the 2M-target-token budget) passes it early
  r.warmup_init_lr = 1e-7
  r.min_lr = 1e-5
  r.clip_norm = 0.0
  r.label_smoothing = 0.0  # CE baseline only (memory=none): fairseq label_smoothed_cross_entropy's ε
  r.vocab_chunk = 0  # output softmax in vocabulary chunks (0 = full logits; label smoothing needs 0)
  r.num_devices = 0  # devices on the data mesh axis; 0 = all
  r.log_every = 25
  r.eval_every = 200  # dev loss every N updates (and at the end); 0 = only at the end
  r.eval_max_pairs = 1000  # dev pairs scored by evaluations (0 = all)
  r.checkpoint_every = 100
  r.keep_checkpoints = 2
  r.keep_best = True  # also export the best parameters by valid `best_metric` to <workdir>/best, evaluated every
  #   eval_every and at the end
  r.best_metric = "ce_ppl"  # ce_ppl (lowest valid perplexity: the model's own distribution, which every decoding
  #   mode starts from) | bleu (highest valid BLEU of beam-5 translations, max length 1.2·x + 10, as the original's
  #   --eval-bleu --best-checkpoint-metric bleu; costs a beam search over the valid pairs at every evaluation)
  r.tensorboard = True  # event files in <workdir>/tb: losses, lr, grad norm, tokens/s, valid ppl, config, hparams
  r.wandb_project = ""  # W&B project (non-empty: scalars and config go there too; pip install "trime-jax[wandb]")
  r.progress = "auto"  # auto (tqdm bar on a terminal or in a notebook, else ETA in the log lines) | bar | log
  r.profile_steps = ""  # "FIRST,LAST" (or "STEP"): jax.profiler trace of those updates to <workdir>/profile
  r.stop_after = 0  # stop (checkpointed, resumable) after this many updates in this invocation; 0 = no limit
  r.allow_config_change = False  # resume a workdir whose config.json differs in fields that change training
  #   (checkpoint.RESUMABLE_CHANGES may always change; the differences go to config_changes.jsonl)

  c.lock()
  return c

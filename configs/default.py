"""Every field of a trime-jax config, with its default. Other configs start from this and override.

Command-line overrides: `--config=configs/demo.py --config.train.num_steps=100`. The returned ConfigDict is
locked, so a misspelt field is an error, not a silently ignored setting.
"""

import ml_collections


def get_config():
  c = ml_collections.ConfigDict()

  c.data = d = ml_collections.ConfigDict()
  d.corpus = "stdlib"  # stdlib | wikitext_mini | wikitext | bytes | tfds:wikitext103|wikitext2|enwik8 (corpora.py)
  d.path = ""  # corpus file or directory (tfds:*: optional manual dir of released files); relative paths are tried
  #   from the cwd, then the repo root
  d.tfds_data_dir = ""  # tfds:* corpora: where TFDS writes its build ("" = $TFDS_DATA_DIR or ~/tensorflow_datasets)
  d.cache_dir = ""  # if set, encoded corpora are cached here and memory-mapped (use for WikiText-103)
  d.split_fractions = (0.9, 0.05, 0.05)  # train/dev/test shares (by document, or by bytes for `bytes`)
  d.split_seed = 0  # seed of the document shuffle before splitting (stdlib, wikitext_mini)
  d.vocab_min_count = 1  # words seen fewer times in train map to <unk> (word corpora)
  d.only_packages = ()  # wikitext with a docs.tsv (docs-wt): keep only these source packages' documents
  d.exclude_packages = ()  # ... and drop these (a held-out domain); vocabulary from the kept training documents
  d.max_files = 400  # stdlib: how many source files to sample (fixed sorted sample)
  d.max_bytes_per_file = 200_000  # stdlib: truncate longer files
  d.segment_len = 256  # L: target tokens per training segment
  d.segmentation = "stream"  # stream (cross document boundaries, fairseq) | document (pad document tails)

  c.model = m = ml_collections.ConfigDict()
  m.vocab_size = 0  # 0: take it from the data; otherwise must equal the data's vocabulary size
  m.backbone = "transformer"  # transformer | srupp (SRU++, trime_jax/srupp.py: carries state across segments)
  m.num_layers = 4  # Transformer blocks
  m.d_model = 128  # hidden size = key dimension D
  m.num_heads = 4  # attention heads
  m.d_ff = 512  # feed-forward inner size
  m.max_len = 512  # longest input the model accepts (training segments and evaluation blocks)
  m.positions = "sinusoidal"  # sinusoidal | learned
  m.position_offset = 0  # position index of a segment's first token (fairseq, paper configs: padding_idx + 1 = 2)
  m.tie_embeddings = True  # share input and output embeddings (adaptive: --tie-adaptive-weights)
  m.final_norm = True  # LayerNorm before the output layer (paper 247M: False, fairseq --no-decoder-final-norm)
  m.dropout = 0.1  # residual / embedding dropout
  m.attention_dropout = 0.0  # dropout on attention probabilities
  m.activation_dropout = 0.0  # dropout after the FFN activation
  m.key_type = "last_ffn_input"  # memory keys g(c): last_ffn_input (paper) | final (g = f)
  m.dtype = "float32"  # compute dtype: float32 | bfloat16 (parameters stay float32)
  m.adaptive_input = False  # banded input embedding, band i of dim D / factor^i (fairseq --adaptive-input)
  m.adaptive_softmax = False  # adaptive softmax: shortlist head + tail clusters (fairseq --adaptive-softmax-cutoff)
  m.adaptive_cutoffs = ()  # band starts for both, e.g. (20_000, 60_000); the vocabulary size closes the last band
  m.adaptive_input_factor = 4.0  # --adaptive-input-factor
  m.adaptive_softmax_factor = 4.0  # --adaptive-softmax-factor (tied: must equal the input's)
  m.tie_adaptive_proj = False  # tail projections shared with the adaptive input's (--tie-adaptive-proj)
  m.adaptive_softmax_dropout = 0.0  # --adaptive-softmax-dropout: on the softmax input and inside each tail
  m.adaptive_tail_ignores_pad = True  # the original's TRIME criterion and scorer: the tail word at c_i + 1 (tail-
  #   relative index 1 = fairseq's <pad>) gets no tail term inside the TRIME softmax (F.cross_entropy's
  #   ignore_index); False: its exact probability. Plain evaluation is exact either way (model.py)
  # Speed only (issue 37; docs/performance.md): how the Transformer is computed, not what it computes.
  m.attention_impl = "xla"  # causal attention: xla (every backend) | cudnn (cuDNN's flash kernel, for the calls
  #   without dropout: NVIDIA GPU, dtype bfloat16 / float16) | pallas (our flash kernel with the dropout inside,
  #   for the training calls with attention dropout: one NVIDIA GPU, head dimension a power of two >= 16)
  m.dropout_mask = "nnx"  # how every dropout draws its mask: nnx (nnx.Dropout: jax's random bits, threefry) |
  #   hash (the pallas kernel's counter hash: a few fused integer ops per element, no random-bit generator; the
  #   attention's are the masks pallas draws). Same distribution, other draws
  m.remat = "none"  # per-block rematerialisation, memory traded for recompute, same numbers: none | block (keep
  #   each block's input only) | dots_saveable (keep matmul outputs) | dots_with_no_batch_dims_saveable (keep the
  #   projections' and FFN's matmul outputs, recompute attention)
  m.adaptive_tail_rows = 1.0  # adaptive softmax, same numbers: 1.0 computes every tail for every row (static
  #   shapes); r < 1 computes tail i only for the rows whose targets are in it, as the original does, up to
  #   ceil(r x rows) of a micro-batch (a batch with more takes the every-row path). One device for now
  # SRU++ only (backbone=srupp; num_layers, d_model, dropout, attention_dropout, dtype are shared; keys are
  # always the final projection's input, key_type="final"):
  m.srupp_attn_dim = 0  # d': attention size (0 = d_model / 4, the paper's ratio)
  m.srupp_num_heads = 1  # attention heads (SRU++ uses one)
  m.srupp_attention_every = 1  # k: attention in layers k, 2k, ... (the others: projected linear)
  m.srupp_highway_bias = -2.0  # initial reset-gate bias b_r
  m.srupp_layer_norm = False  # pre-LN of each layer's input (reference SRUpp default: off)
  m.srupp_normalize_memory = False  # with srupp_layer_norm: LN on the previous segment's inputs too (ours; reference: off)
  m.srupp_eval_same_length = True  # evaluation: a query sees itself and the previous segment's length before it (the
  #   reference's eval_model, same_length=True); False: the whole memory, as in training

  c.trime = t = ml_collections.ConfigDict()
  t.memory = "local"  # training memory: none (vanilla LM) | local | long | ext
  t.batching = "random"  # random | consecutive (long) | bm25 (ext); non-random read t.batch_plan
  t.batch_plan = ""  # batch-plan file written by launch/make_batches.py (consecutive / bm25 batching)
  t.bm25_k = 20  # BM25 batching: hits retrieved per segment, its own among them (Algorithm 1's k; followed from
  #   the second hit on, the original's hits[1:])
  t.bm25_k1, t.bm25_b = 0.9, 0.4  # BM25 scoring (make_batches): the original's, Pyserini's LuceneSearcher defaults
  #   (plans of before 2026-12-07: bm25s's 1.5 / 0.75)
  t.bm25_analyzer = "english"  # english: the segments' words through Lucene's English analysis, searched as the
  #   original's Pyserini (batching/lucene.py; plans of before 2026-12-08 searched token ids) | none: token ids
  t.bm25_exclude_same_document = False  # False: Algorithm 1 as published; True: neighbours from other documents
  t.consecutive_segments = 1  # m: consecutive segments per run in a batch (memory=long)
  t.consecutive_layout = "stream"  # stream (original: runs of the concatenated stream, memory crosses
  #   documents, read in order) | packed (same unpadded runs, a token's memory is its own document only)
  t.consecutive_gpus = 1  # G: the original's GPUs an update's grad_accum micro-batches stand for (stream layout):
  #   its --keep-order gives each GPU a contiguous shard of the runs, so an update holds G far-apart places of the
  #   stream, F = grad_accum / G forwards each; 1: every micro-batch of an update continues the same shards
  t.drop_local_prob = 0.9  # p: chance a segment's local memory is dropped (memory=ext); one draw per segment and update
  t.tau = 1.0  # τ on memory similarities g·g_j/√D during training
  t.stop_gradient_memory = False  # ablation "w/o back-prop to memory": no gradient into memory keys
  t.ce_warmup_steps = -1  # updates trained with plain CE first; -1: 5% of train.num_steps (the paper)
  t.memory_chunk = 0  # blockwise loss: memory tokens per chunk; 0 = derived from a 64 MiB block budget
  t.sharded_variant = "gather"  # >1 device, memory=ext: gather (all-gather keys) | ring (ppermute blocks, O(B/n) memory)
  t.memory_grad = "all"  # >1 device: all (grads reach every device's keys) | local_only (original: own device only)
  t.memory_grad_group_rows = 0  # G > 0: a memory key gets gradient only from queries whose row lies in its group
  #   of G consecutive rows of the global forward batch (= one original GPU's segments: the original's all_gather
  #   detaches other GPUs' keys), on any number of our devices; values unchanged; 0 = no cut by rows. Acts on
  #   long and ext memory (local memory stays in its row); combines with memory_grad=local_only

  c.train = r = ml_collections.ConfigDict()
  r.seed = 0  # parameter init, data order, dropout and drop-local decisions
  r.batch_size = 16  # B: segments per forward pass (the in-batch memory is B·L tokens)
  r.grad_accum = 1  # forward passes per update (tokens per update = grad_accum·B·L)
  r.num_steps = 300  # optimizer updates
  r.optimizer = "adam"  # adam | nag (SGD with Nesterov momentum) | radam (SRU++)
  r.learning_rate = 1e-3  # peak learning rate
  r.adam_b1 = 0.9  # Adam β1
  r.adam_b2 = 0.98  # Adam β2 (fairseq LM default)
  r.adam_eps = 1e-8  # Adam ε
  r.weight_decay = 0.0  # decoupled weight decay (AdamW); 0 = plain Adam
  r.nag_momentum = 0.99  # momentum for nag
  r.schedule = "inverse_sqrt"  # inverse_sqrt | cosine | constant, all after a linear warm-up
  r.warmup_steps = 30  # linear warm-up updates
  r.warmup_init_lr = 1e-7  # learning rate at step 0 of the warm-up
  r.min_lr = 1e-5  # cosine: final learning rate
  r.clip_norm = 0.0  # global gradient-norm clipping; 0 = off
  r.vocab_chunk = 0  # output softmax in vocabulary chunks of this size (0 = full logits); large vocabularies
  r.num_devices = 0  # devices on the `data` mesh axis; 0 = all
  r.log_every = 25  # updates between metric lines (stdout + metrics.jsonl)
  r.eval_every = 0  # updates between dev evaluations during training; 0 = only at the end
  r.eval_max_tokens = 20_000  # dev tokens scored by the periodic evaluation (0 = all)
  r.checkpoint_every = 100  # updates between orbax checkpoints
  r.keep_checkpoints = 2  # checkpoints kept by the CheckpointManager
  r.keep_best = True  # also export the parameters with the lowest dev perplexity to <workdir>/best (ranked by
  #   trime_local ppl for TRIME models, none_ppl for vanilla; evaluated every eval_every updates and at the end)
  r.tensorboard = True  # event files in <workdir>/tb: losses, lr, grad norm, tokens/s, dev ppl, config, hparams
  r.wandb_project = ""  # W&B project (non-empty: scalars, config go there too; pip install "trime-jax[wandb]")
  r.progress = "auto"  # auto (tqdm bar on a terminal or in a notebook, else ETA in the log lines) | bar | log
  r.profile_steps = ""  # "FIRST,LAST" (or "STEP"): jax.profiler trace of those updates to <workdir>/profile
  r.stop_after = 0  # stop (checkpointed, resumable) after this many updates in this invocation; 0 = no limit
  #   (a run longer than one time slot: rerun the same command to continue)
  r.export_on_stop = False  # a stop before the end (train.stop_after, SIGTERM / preemption) also exports the
  #   parameters to <workdir>/partial (meta.json: step, partial): what train.init_from starts from where a
  #   checkpoint (parameters + optimizer moments) cannot travel to the next slot (experiments/docs_wt_long_plan.md)
  r.init_from = ""  # an export to start from when the workdir has no checkpoint: a warm restart at its meta.json
  #   step (schedule, CE warm-up and data order continue from there; the optimizer's moments start afresh, so the
  #   run is not the uninterrupted one); same architecture and vocabulary, step below train.num_steps
  r.allow_config_change = False  # resume a workdir whose config.json differs in fields that change training
  #   (model, data, seed, memory, ...): False refuses, naming them; True continues (recorded in config_changes.jsonl)

  c.eval = e = ml_collections.ConfigDict()
  e.split = "dev"  # dev | test | train (the split scored; eval.tune tunes on dev whatever this is)
  e.block_len = 256  # L_eval: model input length at evaluation
  e.context_window = 128  # C: tokens of each block that are context only (scored: L_eval - C)
  e.sample_break_mode = "none"  # fairseq --sample-break-mode of the scored blocks: none (L_eval - C tokens each)
  #   | complete (whole lines, at most L_eval - C tokens unless one line is longer; context fills up to L_eval)
  e.complete_overlong = "drop"  # complete mode, a line longer than L_eval: drop (the original's default, as
  #   fairseq eval_lm's ignore_invalid_inputs: its tokens are not scored, the next block's context comes from the
  #   last block fed and the long-term store is cleared there; one line says how many lines / tokens; the default
  #   because a paper config reproduces the original's numbers) | refuse (an error naming the line, ours)
  e.batch_size = 8  # blocks per forward pass
  e.devices = 1  # devices the streams (eval.batch_size) are split over, each device whole streams, and the
  #   datastore key pass's forward batches (build_datastore --devices overrides it): 1 (the
  #   original's one GPU) | n (this process's first n; batch_size a multiple of n, of n × processes in a
  #   run of several, each evaluating its share) | 0 (all of this process's);
  #   the same scores up to float rounding (ours, for a host with several accelerators; training's dev evaluation
  #   uses the training mesh's devices without it: LMTask.dev_streams)
  e.memory = "local"  # launch.eval's family: none | local (earlier tokens of the block) | cache (continuous-cache
  #   baseline); launch.eval_ext does not read it: it scores every family, external memory's and these
  e.tau = 1.0  # τ on memory similarities g·g_j/√D at test time (every TRIME family: local, long-term, external)
  e.cache_lambda = 0.1  # λ of the continuous cache: (1-λ)·p_LM + λ·p_cache
  e.cache_theta = 1.0  # θ of the continuous cache: p_cache ∝ Σ exp(θ · g·g_j / √D)
  e.tune = False  # grid-search τ (local) or λ, θ (cache) on dev, then score eval.split at the best point
  e.max_tokens = 0  # score only the first max_tokens targets (0 = the whole split)
  e.frequency_split = "dev"  # the split whose word counts group eval_ext's perplexity by frequency (the paper: the
  #   development set; "train": the training split, as before 2026-12-06)
  e.tune_max_tokens = 0  # eval.tune on the first N dev targets only (0 = as eval.max_tokens): tuning a few
  #   parameters needs less text than reporting, and with a 16M-key datastore every dev token costs a search;
  #   the split's rows (dev's too) still cover eval.max_tokens
  e.mem_size = 0  # long-term memory (TRIME and cache), in eval.long_term_layout's units; >0: batch_size parallel
  #   streams, each with its own store
  e.long_term_layout = "original"  # original: the last mem_size scored tokens before the window's first scored
  #   token (the release's --mem-size M is mem_size = M; the window's context tokens are in the store and again in
  #   the local memory, with different keys) | disjoint: the mem_size tokens before the window (each token once;
  #   ours, docs/long_memory.md "Two store layouts")
  e.reset_at_documents = False  # long-term memory of the query's own document only (the original: False, its
  #   store crosses documents)
  e.datastore = ""  # external memory: datastore directory (launch/build_datastore.py); used by launch/eval_ext.py
  e.index = ""  # FAISS index file; "" = <datastore>/index.faiss
  e.datastore_entries = "all"  # trime_jax.launch.build_datastore: all (every target of the split) | original (the release's
  #   --save-knnlm-dstore: windows of exactly block_len - context_window scored tokens, the context-less first
  #   one only without a context window; the paper configs)
  e.datastore_key_dtype = "float16"  # trime_jax.launch.build_datastore: float16 (the release's --dstore-fp16) | float32
  e.knn_k = 1024  # K: memories retrieved per scored token
  e.nprobe = 32  # IVF lists searched per query (IVF-PQ indexes)
  e.knn_exact = False  # re-score the retrieved entries exactly from the stored float16 keys
  e.knn_gpu = False  # move the FAISS index to GPU 0 (needs a GPU build of faiss; faiss-cpu says so clearly)
  e.overlap_search = False  # dispatch the next group's forward passes (one window's, or eval.search_queries's
  #   windows') before this group's FAISS search and host work, so the accelerator computes while the host
  #   searches (the same numbers; bench/eval_overlap.py; on a CPU both share the cores; on a GPU not yet measured: off until it measures better there; not with
  #   eval.datastore_on_device, whose search is device work)
  e.search_queries = 4096  # queries per FAISS search: the scored queries of ⌊4096 / (eval.batch_size × queries per
  #   window)⌋ consecutive windows (at least one) in one call; on CPU an exact FAISS search costs 4.6× (D = 64) or
  #   12.6× (D = 1,024) more per query in 64-query calls than in 4,096-query ones, and the same below
  #   queries × D = 128,000 (docs/performance.md "Queries per FAISS call"); the same neighbours up to
  #   FAISS's rounding, which differs between its small and large calls (top-K near-ties); 0: one search per
  #   window (before 2026-12-04)
  e.datastore_on_device = False  # exact external memory: every datastore key on the devices (sharded over all of
  #   them), no FAISS top-K; needs the keys to fit in the devices' combined memory (docs/sharded_memory.md)
  e.tau_prime = 1.0  # τ′ of P′ in the interpolation (Appendix A), on g·g_j/√D: original --interp-temp = √D·τ′
  e.interp_memory = "external"  # P′ over: external (top-K retrieved only, the original release) | all (local +
  #   long-term + retrieved, the paper's text)
  e.knn_lambda = 0.3  # λ of (1-λ)·P + λ·P′ (TrimeLM_ext) and of kNN-LM's (1-λ)·p_LM + λ·p_kNN
  e.knn_theta = 1.0  # θ of kNN-LM: p_kNN ∝ Σ exp(θ · g·g_j / √D) over the retrieved (knnlm_cache: and local) keys
  #   (eval.knnlm_metric=l2: exp(θ · -|g - g_j|²), θ = 1 / the original's --softmax-temp)
  e.knnlm_metric = "ip"  # the kNN-LM families' (knnlm, knnlm_cache) retrieval and similarity: ip (the top-K of the
  #   one inner-product search every family shares, sim = g·g_j/√D; ours, the default: one index per datastore,
  #   what every datastore built so far has and `make demo` uses) | l2 (the original release's kNN-LM baseline,
  #   fairseq/knnlm.py with its default --faiss-metric-type l2: the top-K of the datastore's L2 index
  #   <datastore>/index_l2.faiss, built by build_datastore --index_metric=l2, and sim = -|g - g_j|² recomputed
  #   from the stored float16 keys, no √D; the TRIME families keep the inner-product search). The paper quotes
  #   its kNN-LM numbers from Khandelwal et al. (L2): a faithful kNN-LM baseline sets l2 (docs/external_memory.md)
  c.lock()  # typos in field names are errors, in code as on the command line
  return c

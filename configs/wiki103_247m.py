"""WikiText-103, 247M TrimeLM (paper Table "model_config", column 1; Baevski & Auli 2019 architecture).

Needs WikiText-103 (not available offline here): put wiki.{train,valid,test}.tokens in data/wikitext-103.
The model is the paper's: tied adaptive input and adaptive softmax (cutoffs 20k/60k, factor 4, tied
projections), 246,932,928 parameters (paper: 247M); docs/paper_models.md.
Every training field follows train_scripts/wiki103-247M-trime.sh of the original release (the _long and
_ext scripts differ only in criterion and batching); docs/paper_configs.md lists each field's source.
"""

from trime_jax.configs import default


def get_config():
  c = default.get_config()
  c.data.corpus = "wikitext"  # wiki.{train,valid,test}.tokens
  c.data.path = "data/wikitext-103"  # directory with the three token files
  c.data.cache_dir = "data/wikitext-103/trime_cache"  # tokenized once, then memory-mapped
  c.data.segment_len = 3072  # L (training)
  c.data.segmentation = "stream"  # fairseq --sample-break-mode none
  # Model: --arch transformer_lm_wiki103 (fairseq transformer_lm.py: transformer_lm_baevski_wiki103 over
  # transformer_lm_big over base_lm_architecture); field-by-field sources: docs/paper_configs.md.
  c.model.vocab_size = 267_735  # WikiText-103 vocabulary (checked against the data)
  c.model.num_layers = 16  # arch decoder_layers 16
  c.model.d_model = 1024  # arch (transformer_lm_big) decoder_embed_dim 1024
  c.model.num_heads = 8  # arch decoder_attention_heads 8
  c.model.d_ff = 4096  # arch (transformer_lm_big) decoder_ffn_embed_dim 4096
  c.model.max_len = 3072  # --tokens-per-sample 3072 (max_target_positions)
  c.model.positions = "sinusoidal"  # arch decoder_learned_pos False
  c.model.position_offset = 2  # fairseq positions start at padding_idx + 1 = 2
  c.model.tie_embeddings = True  # arch tie_adaptive_weights True (adaptive input and softmax share E_i)
  c.model.adaptive_input = True  # arch adaptive_input True
  c.model.adaptive_softmax = True  # arch adaptive_softmax_cutoff '20000,60000'
  c.model.adaptive_cutoffs = (20_000, 60_000)  # arch adaptive_input_cutoff = adaptive_softmax_cutoff 20000,60000
  c.model.adaptive_input_factor = 4.0  # arch adaptive_input_factor default 4
  c.model.adaptive_softmax_factor = 4.0  # arch adaptive_softmax_factor default 4
  c.model.tie_adaptive_proj = True  # arch tie_adaptive_proj True
  c.model.adaptive_softmax_dropout = 0.2  # arch adaptive_softmax_dropout 0.2
  c.model.final_norm = False  # arch no_decoder_final_norm True: no LayerNorm before the output layer
  c.model.dropout = 0.3  # arch dropout 0.3
  c.model.attention_dropout = 0.1  # arch attention_dropout 0.1
  c.model.activation_dropout = 0.1  # arch activation_dropout 0.1
  c.model.key_type = "last_ffn_input"  # --knn-keytype last_ffn_input
  c.model.dtype = "bfloat16"  # --fp16 (bfloat16 here)
  c.trime.memory = "local"  # TrimeLM; long: see wiki103_150m; ext: memory=ext + batching=bm25
  c.trime.ce_warmup_steps = 12_609  # --ce-warmup-epoch 9: 9 × 1,401 updates (33,603 segments / 24 per update)
  c.trime.memory_grad = "local_only"  # >1 device: the original's all_gather cuts gradients into other GPUs' keys
  c.trime.memory_grad_group_rows = 1  # --max-tokens 3072 = one segment per GPU: trime_ext_loss / trime_long_loss
  #   gather the other segments' keys without gradient, so a key gets gradient from its own segment's queries only
  #   (however many segments one of our devices holds; no effect on the local-memory TrimeLM)
  c.train.seed = 1  # --seed 1
  c.train.batch_size = 8  # paper table: 8 segments per forward (24,576 in-batch memories); the script on
  #   the README's 4 GPUs: --max-tokens 3072 = 1 segment per GPU, 4 per forward, --update-freq 6
  c.train.grad_accum = 3  # paper table: 3 (24 segments = 73,728 tokens per update, as 4 GPUs × --update-freq 6)
  c.train.num_steps = 286_000  # --max-update 286000
  c.train.optimizer = "nag"  # --optimizer nag
  c.train.learning_rate = 1.0  # --max-lr 1.0 (cosine peak)
  c.train.nag_momentum = 0.99  # nag --momentum default 0.99
  c.train.weight_decay = 0.0  # nag --weight-decay default 0
  c.train.clip_norm = 0.1  # --clip-norm 0.1
  c.train.schedule = "cosine"  # --lr-scheduler cosine (one period: 16k + 270k = --max-update, so --t-mult 2
  #   and --lr-shrink 0.75 never act). The period here is num_steps - warmup_steps (--lr-period-updates 270000
  #   only while num_steps is 286k): a shorter num_steps re-sizes the cosine to fit the run
  c.train.warmup_steps = 16_000  # --warmup-updates 16000
  c.train.warmup_init_lr = 1e-7  # --warmup-init-lr 1e-07
  c.train.min_lr = 1e-4  # --lr 0.0001 (fairseq cosine's floor; --min-lr 1e-09 only stops training)
  c.train.vocab_chunk = 16_384  # head and tails in chunks of at most this (the 207,735-word tail in 13)
  c.train.log_every = 100  # metric lines
  c.train.checkpoint_every = 2000  # orbax checkpoints
  c.train.eval_max_tokens = 100_000  # periodic dev evaluation subset
  c.eval.block_len = 3072  # fairseq --tokens-per-sample
  c.eval.context_window = 2560  # scored tokens per block: 512 (the paper's evaluation segment length)
  c.eval.sample_break_mode = "complete"  # --sample-break-mode complete (every released 247M evaluation)
  c.eval.batch_size = 1  # blocks per forward
  # Evaluation as released (run_pretrained_models.md). TrimeLM: --use-local --softmax-temp 1.17. TrimeLM_long:
  # --softmax-temp 1.22 --mem-size 12288 -> eval.tau=1.22, eval.mem_size=12288 (the original store
  # layout, the default), reset_at_documents=False. TrimeLM_ext: --softmax-temp 1.25, the same store, K=1024,
  # --probe 32, --interp-temp 10.5 --lmbda 0.3 -> eval.tau_prime=10.5/√1024=0.328, eval.knn_lambda=0.3.
  c.eval.tau = 1.17  # --softmax-temp (TrimeLM)
  c.eval.reset_at_documents = False  # the original's store never resets at documents
  c.eval.knn_k = 1024  # --k
  c.eval.datastore_entries = "original"  # eval_lm.py --save-knnlm-dstore's windows (neither the context-less first
  #   window, which fairseq pads to block + context and skips, nor the last partial one)
  c.eval.datastore_key_dtype = "float16"  # --dstore-fp16
  c.eval.nprobe = 32  # --probe
  c.eval.interp_memory = "external"  # --use-interp: P′ over the retrieved top-K only
  c.eval.tau_prime = 10.5 / 32  # --interp-temp 10.5 in our units (τ′_original = √D · τ′, D = 1024)
  c.eval.knn_lambda = 0.3  # --lmbda
  return c

#!/usr/bin/env bash
# Train on several GPUs: the global batch is sharded over a `data` mesh of all GPUs, with the sharded TRIME
# loss (trime.sharded_variant = gather | ring) inside the jitted step.
#
# One host, all its GPUs (a single process drives them; no jax.distributed needed):
#   launch/multi_gpu.sh --config=configs/wiki103_247m.py --workdir=runs/wt103_247m
#   CUDA_VISIBLE_DEVICES=0,1,2,3 launch/multi_gpu.sh --config=... --workdir=...   # a subset of the GPUs
# Several hosts, one process per host driving all of its GPUs: run on every host, NODE_RANK = 0 .. NNODES-1,
# MASTER_ADDR = a host name/IP of the NODE_RANK=0 host that every host can reach:
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=gpu-node-0 MASTER_PORT=29500 launch/multi_gpu.sh --config=... \
#       --workdir=/shared/runs/wt103_247m
# (under SLURM, `srun --ntasks-per-node=1 env TRIME_DISTRIBUTED=auto launch/multi_gpu.sh ...` lets jax
# detect the cluster itself instead.)
#
# Requirements: the same repository and venv on every host (`make install` with a CUDA jax, e.g.
# `pip install -U "jax[cuda12]"`), --workdir on storage all hosts share (orbax writes one checkpoint from all
# processes), train.batch_size divisible by the total number of GPUs. XLA's latency-hiding scheduler is
# switched on so the all-gather / ring transfers of the memory keys can overlap compute.
# PROGRAM=eval or PROGRAM=eval_ext runs that evaluation instead (--config=... --checkpoint=...): on one host
# set --config.eval.devices=0 (every GPU, no jax.distributed needed); on several, each host evaluates its share
# of eval.batch_size's streams (a multiple of the hosts) and searches the datastore for its own queries; the
# NODE_RANK=0 host prints the table and writes --output (on storage every host sees; the NODE_RANK=0 host checks
# it first and a refusal stops every host). Stop a run of several hosts with SIGTERM on every host (a
# preemption: each saves at the same update); a Ctrl-C on one host stops that host (exit 130) and JAX aborts the
# others (2 CPU processes, experiments/multiprocess_ctrl_c.py: 0.2 s after when it is the NODE_RANK=0 host,
# 16.5-20 s after otherwise).
set -euo pipefail

PYTHON="${PYTHON:-.venv/bin/python}"
PROGRAM="${PROGRAM:-train}"

if [[ $# -eq 0 ]]; then
  sed -n '2,/^set /{/^#/p}' "$0"  # the comment above
  exit 2
fi
case "$PROGRAM" in
  train|eval|eval_ext) ;;
  *) echo "error: PROGRAM=$PROGRAM: one of train, eval, eval_ext" >&2; exit 2 ;;
esac

cd "$(dirname "$0")/.."
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_latency_hiding_scheduler=true"
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}"

if [[ "${NNODES:-1}" -gt 1 ]]; then
  : "${NODE_RANK:?set NODE_RANK (0 .. NNODES-1)}" "${MASTER_ADDR:?set MASTER_ADDR (host of NODE_RANK=0)}"
  export JAX_NUM_PROCESSES="$NNODES" JAX_PROCESS_ID="$NODE_RANK"
  export JAX_COORDINATOR_ADDRESS="$MASTER_ADDR:${MASTER_PORT:-29500}"
fi

exec "$PYTHON" -m trime_jax.distributed "trime_jax.launch.$PROGRAM" "$@"

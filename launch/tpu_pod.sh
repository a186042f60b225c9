#!/usr/bin/env bash
# Train on a Cloud TPU pod slice (several hosts): one process per TPU VM worker, one `data` mesh over all
# chips, each host loading only its rows of every global batch (trime_jax/distributed.py).
#
# From your workstation (runs the same command on every worker over `gcloud ... ssh --worker=all`):
#   TPU_NAME=my-v5e-16 ZONE=us-west4-a launch/tpu_pod.sh --config=configs/wiki103_247m.py \
#       --workdir=/mnt/shared/runs/wt103_247m --config.trime.memory=ext --config.trime.sharded_variant=ring
# On one worker yourself (e.g. inside your own multi-worker launcher), leave TPU_NAME unset:
#   launch/tpu_pod.sh --config=... --workdir=...
#
# Requirements:
#   * the repository at $REPO_DIR (default ~/trime-jax) on every worker, with its venv (`make install`);
#   * --workdir on storage every worker sees at the same path (NFS / Filestore / a gcsfuse mount): orbax
#     writes one checkpoint from all hosts, and every host reads the data files under it;
#   * train.batch_size divisible by the number of chips (rows are sharded over all of them).
# jax.distributed is started by jax's own Cloud TPU detection (TRIME_DISTRIBUTED=auto); rerunning the same
# command resumes from the newest checkpoint.
# PROGRAM=eval or PROGRAM=eval_ext runs that evaluation instead (--config=... --checkpoint=...): each host
# evaluates its share of eval.batch_size's streams (a multiple of the hosts) and searches the datastore (on
# storage every host sees) for its own queries; worker 0 prints the table and writes --output (give a path on
# that storage: every worker checks it before the work).
set -euo pipefail

REPO_DIR="${REPO_DIR:-~/trime-jax}"
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

if [[ -n "${TPU_NAME:-}" ]]; then
  : "${ZONE:?set ZONE to the zone of the TPU}"
  args=$(printf '%q ' "$@")
  exec gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" ${PROJECT:+--project="$PROJECT"} --worker=all \
    --command="cd $REPO_DIR && TRIME_DISTRIBUTED=auto $PYTHON -m trime_jax.distributed trime_jax.launch.$PROGRAM $args"
fi

cd "$(dirname "$0")/.."
TRIME_DISTRIBUTED=auto exec "$PYTHON" -m trime_jax.distributed "trime_jax.launch.$PROGRAM" "$@"

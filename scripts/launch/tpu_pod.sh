#!/usr/bin/env bash
# A conversion on a Cloud TPU pod slice: install on every worker, then train.py on every worker at once.
#
#   scripts/launch/tpu_pod.sh TPU_NAME ZONE CONFIG gs://BUCKET/RUN [train.py flags...]
#   scripts/launch/tpu_pod.sh my-v5p-64 us-east5-a configs/qwen3_1p7b_hydrahead.py:7to1 gs://my-bucket/qwen3-7to1
#
# Environment: REPO (the git URL to clone, default this checkout's origin), REV (the commit to run, default this
# checkout's HEAD), PROJECT (gcloud's --project, default its configured one).
# Every worker clones the same commit and installs it with the TPU extra (jax[tpu]); the workdir is a gs:// URL,
# which every worker reads and writes. On a TPU VM JAX finds the coordinator, the workers and their chips itself:
# train.py needs only --config.distributed=True. A preempted slice sends SIGTERM to every worker; the workers agree
# on a step, checkpoint it and exit 143; rerunning this script resumes the run from gs://.
set -euo pipefail

if [ $# -lt 4 ]; then
  echo "usage: scripts/launch/tpu_pod.sh TPU_NAME ZONE CONFIG gs://BUCKET/RUN [train.py flags...]" >&2
  exit 64
fi
tpu=$1 zone=$2 config=$3 workdir=$4
shift 4
case "$workdir" in
  gs://?*) ;;
  *) echo "tpu_pod.sh: the workdir must be gs://BUCKET/PATH (every worker reads and writes it), got '$workdir'" >&2
     exit 64 ;;
esac
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
repo=${REPO:-$(git -C "$here" remote get-url origin)}
rev=${REV:-$(git -C "$here" rev-parse HEAD)}
project=()
[ -n "${PROJECT:-}" ] && project=(--project="$PROJECT")
flags=$(printf ' %q' "$@")

on_all_workers() {
  gcloud compute tpus tpu-vm ssh "$tpu" --zone="$zone" "${project[@]}" --worker=all --command="$1"
}

on_all_workers "set -e; [ -d hydrahead-jax ] || git clone -q $(printf %q "$repo") hydrahead-jax; cd hydrahead-jax; \
git fetch -q origin; git checkout -q $(printf %q "$rev"); [ -x .venv/bin/python ] || python3 -m venv .venv; \
.venv/bin/pip install -q --upgrade pip; .venv/bin/pip install -q -e '.[tpu]'"
on_all_workers "cd hydrahead-jax && .venv/bin/python train.py --config $(printf %q "$config") \
--workdir $(printf %q "$workdir") --config.distributed=True$flags"

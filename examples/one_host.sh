#!/usr/bin/env bash
# One host with several GPUs (or a CPU-only laptop), every process started by `jaxzero launch`.
#
#   bash examples/one_host.sh            # GPUs: one process per GPU
#   CPU=1 bash examples/one_host.sh      # no GPU: 2 processes x 2 simulated devices
#
# JAX is happy with one process driving all local GPUs (--nproc-per-node 1, the simplest and
# usually fastest); one process per GPU mirrors torchrun (each process is given
# LOCAL_RANK and uses the GPU of that index). Both train the same model, the same way.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${CPU:-0}" == 1 ]]; then
  exec jaxzero launch --nproc-per-node 2 --simulate-devices 2 -- \
    jaxzero train --config configs/tiny.yaml --name launch-cpu
fi
GPUS=$(nvidia-smi -L | wc -l)
exec jaxzero launch --nproc-per-node "$GPUS" -- \
  jaxzero train --config configs/gpt2-small.yaml --precision bf16 --name launch-1node

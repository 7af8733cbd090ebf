#!/usr/bin/env bash
# Two nodes by hand: run this on both, with the address of node 0 (the host) and a free port.
#
#   node 0:  bash examples/two_nodes.sh 0 10.0.0.1
#   node 1:  bash examples/two_nodes.sh 1 10.0.0.1
#
# Rank 0 (on node 0) runs JAX's coordinator at MASTER_ADDR:MASTER_PORT; every process connects
# to it within --init-timeout seconds or stops with a message naming the setting at fault.
# mesh.group_size=node shards the ZeRO state inside each node (fast links) and replicates it
# across the two nodes: one all-reduce of each gradient shard per step crosses the network.
set -euo pipefail
NODE_RANK=${1:?node rank: 0 or 1}
MASTER_ADDR=${2:?address of node 0, reachable from node 1}
MASTER_PORT=${3:-29500}
cd "$(dirname "$0")/.."
exec jaxzero launch --nnodes 2 --node-rank "$NODE_RANK" --nproc-per-node 1 \
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" --max-restarts 0 -- \
  jaxzero train --config configs/gpt2-small.yaml --precision bf16 \
  --set mesh.group_size=node --name two-nodes

#!/bin/sh
# The figures of docs/cells.md: three multi-turn shapes (seed 0), 8 cells x 2 simulated workers
# against one scheduler over the same 16 workers (same KV per worker), at load x1 and x1.5.
set -e
run() {
  name=$1; shift
  echo "== $name: $*"
  "${PYTHON:-python}" -c 'from llmserve.cli import main; main()' bench sim --workload multiturn --cells 8 --sim-workers 2 \
    --policies continuous+paged --kv-capacity 20000 --think-time 2 --loads 1,1.5 \
    --router cache-aware,round-robin,least-loaded,session,single --no-progress \
    --out results/cells --name "$name" "$@"
}
run short --conversations 256 --turns 4 --conversation-rate 16 --system-prompts 4 \
  --system-tokens 256 --user-tokens 64 --answer-tokens 64
run long --conversations 32 --turns 16 --conversation-rate 2 --system-prompts 2 \
  --system-tokens 256 --user-tokens 96 --answer-tokens 96
run hot --conversations 192 --turns 4 --conversation-rate 12 --system-prompts 1 \
  --system-tokens 1024 --user-tokens 64 --answer-tokens 64

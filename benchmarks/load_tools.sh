#!/usr/bin/env bash
# Run a third-party load tool against a running `pagellm serve`, with the command lines of
# docs/clients.md. The tools are not pagellm dependencies: install the one you want in its own
# environment first (pip install aiperf | guidellm | inference-perf). Nothing here downloads a
# model: the tokenizer is the one pagellm converted from the default GGUF (`pagellm warmup`).
#
#   .venv/bin/pagellm serve --port 8000 &          # the default model, as served to clients
#   benchmarks/load_tools.sh aiperf|guidellm|inference-perf [BASE_URL]
#
# BASE_URL defaults to http://127.0.0.1:8000. MODEL (the served name) and TOKENIZER (a local
# tokenizer folder) may be set in the environment; OUT (default ./load-tools-out) gets results.
set -euo pipefail
cd "$(dirname "$0")/.."

tool=${1:?usage: $0 aiperf|guidellm|inference-perf [BASE_URL]}
base_url=${2:-http://127.0.0.1:8000}
model=${MODEL:-SmolLM2-135M-Instruct}
out=${OUT:-load-tools-out}
if [ -z "${TOKENIZER:-}" ]; then
  .venv/bin/pagellm warmup >/dev/null  # makes sure the converted folder exists
  TOKENIZER=$(.venv/bin/python -c "from pagellm.models.gguf_cache import cache_dir_for
from pagellm.models.loader import default_model_path
print(cache_dir_for(default_model_path()))")
fi
mkdir -p "$out"
# Offline: the tools must load the local tokenizer, never look a model name up on the Hub.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

case "$tool" in
  aiperf)
    # Chat, streamed: TTFT and inter-token latency; 4 concurrent users, 100 requests.
    aiperf profile \
      --model "$model" --tokenizer "$TOKENIZER" \
      --url "$base_url" --endpoint-type chat --streaming \
      --synthetic-input-tokens-mean 128 --synthetic-input-tokens-stddev 0 \
      --output-tokens-mean 64 --output-tokens-stddev 0 --extra-inputs ignore_eos:true \
      --concurrency 4 --request-count 100 --random-seed 123 \
      --artifact-dir "$out/aiperf"
    ;;
  guidellm)
    # A rate sweep (guidellm < 0.4: --rate-type instead of --profile); it streams with
    # stream_options.continuous_usage_stats. Its reports land in the current folder.
    mkdir -p "$out/guidellm"
    (cd "$out/guidellm" && guidellm benchmark \
      --target "$base_url" --model "$model" --processor "$TOKENIZER" \
      --request-type chat_completions \
      --profile sweep --max-seconds 30 \
      --data "prompt_tokens=128,output_tokens=64")
    ;;
  inference-perf)
    config="$out/inference-perf.yml"
    cat > "$config" <<EOF
load:
  type: constant
  stages:
  - rate: 1
    duration: 30
  - rate: 2
    duration: 30
api:
  type: completion
  streaming: true
server:
  type: vllm
  model_name: $model
  base_url: $base_url
  ignore_eos: true
tokenizer:
  pretrained_model_name_or_path: $TOKENIZER
data:
  type: random
  input_distribution: {min: 64, max: 256, mean: 128, std_dev: 32, total_count: 200}
  output_distribution: {min: 32, max: 128, mean: 64, std_dev: 16, total_count: 200}
report:
  request_lifecycle: {summary: true, per_stage: true, per_request: false}
storage:
  local_storage: {path: $out/inference-perf}
EOF
    inference-perf --config_file "$config"
    ;;
  *)
    echo "unknown tool $tool: aiperf, guidellm or inference-perf" >&2
    exit 2
    ;;
esac

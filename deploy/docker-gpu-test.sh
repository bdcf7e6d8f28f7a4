#!/usr/bin/env bash
# End-to-end check with Docker and a GPU (`make docker-gpu-test`); needs a
# Docker engine with the NVIDIA runtime, registry access (vllm/vllm-openai)
# and network access to the model hub. Not in CI (no GPU there); CI runs
# `make docker-test`, the CPU container tests.
#
# Builds both images, starts the compose stack with a small multimodal model,
# sends one image, restarts the vLLM container (a fresh engine: vLLM's own
# encoder cache is empty), sends the same image again, and checks that the
# daemon served it (a hit and a load) instead of the encoder.
set -euo pipefail
cd "$(dirname "$0")"

export MODEL=${MODEL:-Qwen/Qwen2-VL-2B-Instruct}
export EC_CPU_BYTES=${EC_CPU_BYTES:-2GiB}
export SHM_SIZE=${SHM_SIZE:-3g}
COMPOSE=(docker compose -f compose.yaml -p ec-daemon-test)
IMAGE_URL=${IMAGE_URL:-https://upload.wikimedia.org/wikipedia/commons/4/47/PNG_transparency_demonstration_1.png}

cleanup() { "${COMPOSE[@]}" down -v --remove-orphans >/dev/null 2>&1 || true; }
trap cleanup EXIT

wait_for_vllm() {
  echo ">> waiting for vLLM to serve $MODEL (model download and start-up take minutes)"
  for _ in $(seq 1 180); do
    if curl -fsS http://127.0.0.1:8000/health >/dev/null 2>&1; then return 0; fi
    sleep 5
  done
  echo "vLLM did not become healthy" >&2
  "${COMPOSE[@]}" logs --tail 100 vllm >&2
  return 1
}

ask() {
  curl -fsS http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' -d "{
    \"model\": \"$MODEL\", \"max_tokens\": 16, \"temperature\": 0,
    \"messages\": [{\"role\": \"user\", \"content\": [
      {\"type\": \"image_url\", \"image_url\": {\"url\": \"$IMAGE_URL\"}},
      {\"type\": \"text\", \"text\": \"Describe the image.\"}]}]}" | python3 -c \
    'import json,sys; print(json.load(sys.stdin)["choices"][0]["message"]["content"])'
}

stat() {
  "${COMPOSE[@]}" exec -T ec-daemon ec-daemon stats --json | python3 -c \
    "import json,sys; print(json.load(sys.stdin)[\"$1\"])"
}

echo ">> building images and starting the stack"
"${COMPOSE[@]}" up -d --build
wait_for_vllm
first=$(ask)
echo "first answer:  $first"
saves=$(stat saves)
[ "$saves" -ge 1 ] || { echo "FAIL: the daemon saved nothing" >&2; exit 1; }

echo ">> restarting vLLM (a fresh engine with an empty encoder cache)"
"${COMPOSE[@]}" restart vllm
wait_for_vllm
second=$(ask)
echo "second answer: $second"
loads=$(stat loads)
hits=$(stat hits)
echo "daemon: saves=$saves loads=$loads hits=$hits"
[ "$loads" -ge 1 ] && [ "$hits" -ge 1 ] || { echo "FAIL: no daemon hit" >&2; exit 1; }
[ "$first" = "$second" ] || { echo "FAIL: answers differ" >&2; exit 1; }
echo "PASS: the second engine loaded the encoder output from ec-daemon"

#!/usr/bin/env bash
# Install Kiln, start the API, a worker and the inference server on the embedded defaults
# (SQLite, Celery over SQLite, a local store under ./kiln-data), fine-tune kiln-tiny on the
# sample dataset, download the LoRA adapter to ./kiln-adapter.zip and ask the fine-tuned model a
# question through the openai SDK. Stops the services when it ends.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh server,engine,examples
export KILN_HOME="${KILN_HOME:-$PWD/kiln-data}"
export KILN_INFERENCE_URL="${KILN_INFERENCE_URL:-http://127.0.0.1:8766}"
port="${KILN_PORT:-8000}"
.venv/bin/kiln-admin migrate
key=$(.venv/bin/kiln-admin create-key --owner quickstart --name quickstart 2>/dev/null)
mkdir -p "$KILN_HOME/logs"
.venv/bin/uvicorn --factory api.app:create_app --host 127.0.0.1 --port "$port" --log-level warning \
  --timeout-keep-alive 75 >"$KILN_HOME/logs/api.log" 2>&1 &
api=$!
.venv/bin/celery -A workers.celery_app worker --pool=solo --loglevel=INFO >"$KILN_HOME/logs/worker.log" 2>&1 &
worker=$!
.venv/bin/python -m workers.inference >"$KILN_HOME/logs/inference.log" 2>&1 &
inference=$!
trap 'kill $api $worker $inference 2>/dev/null; wait $api $worker $inference 2>/dev/null || true' EXIT
.venv/bin/python scripts/quickstart.py --base-url "http://127.0.0.1:$port" --api-key "$key" --out kiln-adapter.zip

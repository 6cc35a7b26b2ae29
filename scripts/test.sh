#!/usr/bin/env bash
# Install Kiln with its test dependencies, make sure PostgreSQL and Redis answer on 127.0.0.1,
# check lint, format and types (ruff, mypy), and run the whole test suite (unit, and integration
# against real processes and services).
set -euo pipefail
cd "$(dirname "$0")/.."
# Debian packages: the services, and Chromium for the browser tests of the monitoring page.
need=""
command -v pg_isready >/dev/null || need="$need postgresql"
command -v redis-server >/dev/null || need="$need redis-server"
command -v chromium >/dev/null || need="$need chromium"
if [ -n "$need" ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $need >/dev/null
fi
if ! pg_isready -q -h 127.0.0.1 -p 5432; then
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start
fi
if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  mkdir -p /var/lib/redis /var/log/redis
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
fi
for _ in $(seq 30); do pg_isready -q -h 127.0.0.1 && redis-cli -h 127.0.0.1 ping >/dev/null 2>&1 && break; sleep 1; done
source scripts/setup_env.sh server,engine,dev,tracking
# fla-core's naive KDA is a parity oracle; --no-deps keeps triton off the CPU machine (with
# triton present, transformers routes KDA through Triton kernels and fails without a GPU).
.venv/bin/python -m pip install -q --no-deps fla-core==0.6.0
# Triton for its interpreter (the kernels' CPU tests), in .triton for that reason too.
[ -d .triton/triton ] || .venv/bin/python -m pip install -q --no-deps --target .triton triton==3.6.0
# Lint, format and types first: a finding fails the run before the suite starts.
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
exec .venv/bin/python -m pytest "$@"

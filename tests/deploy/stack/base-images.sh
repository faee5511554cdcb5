#!/usr/bin/env bash
# The base images compose.yaml and docker/Dockerfile start from, for tests/deploy/test_stack.py.
# Prints three lines for compose's environment:
#   GPULOOM_PYTHON_IMAGE=...  GPULOOM_POSTGRES_IMAGE=...  GPULOOM_REDIS_IMAGE=...
# The official images when the engine has them or a registry serves them; otherwise test
# fixtures made here (no registry answers on the machines CI runs on): a Debian bookworm made
# with debootstrap and imported (Debian's Python 3.11 with venv, the host's CA bundle so that
# image builds reach PyPI and Debian), and stand-ins for PostgreSQL and Redis built on it from
# Debian's packages (fixtures/). Fixtures are tagged by a hash of their definition and reused
# while it holds. They are test fixtures only: the shipped Dockerfile is not changed for them.
set -euo pipefail
self="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$self")"
export DOCKER_BUILDKIT=0

PYTHON_IMAGE=python:3.11.10-slim-bookworm
POSTGRES_IMAGE=postgres:16.4-bookworm
REDIS_IMAGE=redis:7.4.1-bookworm
MIRROR=http://deb.debian.org/debian
HOST_CA=/etc/ssl/certs/ca-certificates.crt

have() { docker image inspect "$1" >/dev/null 2>&1; }
pull() { have "$1" || timeout 120 docker pull --quiet "$1" >/dev/null 2>&1; }

if pull "$PYTHON_IMAGE" && pull "$POSTGRES_IMAGE" && pull "$REDIS_IMAGE"; then
  printf 'GPULOOM_PYTHON_IMAGE=%s\nGPULOOM_POSTGRES_IMAGE=%s\nGPULOOM_REDIS_IMAGE=%s\n' \
    "$PYTHON_IMAGE" "$POSTGRES_IMAGE" "$REDIS_IMAGE"
  exit 0
fi

tag="$(cat "$self" fixtures/* | sha256sum | cut -c1-12)"
base="gpuloom-fixture/bookworm:$tag"
postgres="gpuloom-fixture/postgres:$tag"
redis="gpuloom-fixture/redis:$tag"

if ! have "$base"; then
  [ "$(id -u)" = 0 ] || { echo "base-images.sh: making $base needs root (debootstrap)" >&2; exit 1; }
  command -v debootstrap >/dev/null 2>&1 || {
    echo "base-images.sh: installing debootstrap (apt-get)" >&2
    DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq debootstrap >&2
  }
  root="$(mktemp -d /var/tmp/gpuloom-bookworm.XXXXXX)"
  trap 'rm -rf "$root"' EXIT
  echo "base-images.sh: debootstrap bookworm into $root" >&2
  timeout 900 debootstrap --variant=minbase \
    --include=python3,python3-venv,python-is-python3,ca-certificates \
    bookworm "$root" "$MIRROR" >"$root.log" 2>&1 || {
    echo "base-images.sh: debootstrap failed; its log ends:" >&2
    tail -n 5 "$root.log" >&2
    exit 1
  }
  rm -f "$root.log"
  # The host's CA bundle: where TLS to PyPI is intercepted, the host trusts its CA.
  [ -f "$HOST_CA" ] && cp "$HOST_CA" "$root/etc/ssl/certs/ca-certificates.crt"
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin
  tar -C "$root" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change "ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt" \
    --change 'CMD ["python3"]' - "$base" >/dev/null
  echo "base-images.sh: imported $base" >&2
fi
for stand_in in postgres redis; do
  image="gpuloom-fixture/$stand_in:$tag"
  if ! have "$image"; then
    echo "base-images.sh: building $image" >&2
    docker build --quiet --build-arg "BASE=$base" -f "fixtures/$stand_in.Dockerfile" \
      -t "$image" fixtures >/dev/null
  fi
done
printf 'GPULOOM_PYTHON_IMAGE=%s\nGPULOOM_POSTGRES_IMAGE=%s\nGPULOOM_REDIS_IMAGE=%s\n' \
  "$base" "$postgres" "$redis"

# Sourced by scripts/up and scripts/test: make .venv (Python >= 3.11) and install the project
# into it, editable, with the given extras. Re-installs only when what the install depends on
# (pyproject.toml, setup.py, protos/) changed since the last install.
ensure_venv() {
  local extras="$1" root python stamp_file wanted
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
  if [ ! -x "$root/.venv/bin/python" ]; then
    python=""
    for candidate in python3.13 python3.12 python3.11 python3; do
      if command -v "$candidate" >/dev/null 2>&1 &&
        "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
        python="$candidate"
        break
      fi
    done
    if [ -z "$python" ]; then
      echo "gpuloom needs Python 3.11 or newer (with venv); none found on PATH" >&2
      exit 1
    fi
    echo "creating .venv with $($python --version)"
    "$python" -m venv "$root/.venv"
    "$root/.venv/bin/python" -m pip install --quiet --upgrade pip
  fi
  stamp_file="$root/.venv/.gpuloom-installed"
  wanted="$extras $(cat "$root/pyproject.toml" "$root/setup.py" "$root"/protos/generate.py \
    $(find "$root/protos" -name '*.proto' | sort) | sha256sum | cut -d' ' -f1)"
  if [ ! -f "$stamp_file" ] || [ "$(cat "$stamp_file")" != "$wanted" ] ||
    ! "$root/.venv/bin/python" -c 'import gpuloom.v1.profile_store_pb2' 2>/dev/null; then
    echo "installing gpuloom${extras:+[$extras]} into .venv (generates the protobuf stubs)"
    "$root/.venv/bin/python" -m pip install --quiet --disable-pip-version-check \
      -e "$root${extras:+[$extras]}"
    echo "$wanted" >"$stamp_file"
  fi
}

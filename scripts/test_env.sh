#!/usr/bin/env bash
# Sets up what the test suite needs, on a fresh machine or again on a warm one:
#   - .venv/: a project-local Python environment from tests/requirements*.txt, reinstalled
#     only when those files change (a stamp holds their digest);
#   - Debian's prometheus (with promtool), strace and systemd-analyze: installed with apt when
#     run as root (or with passwordless sudo), else named with the command that installs them.
# Prints nothing on a warm machine but one line; exits non-zero with what to do otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv
PY=${PYTHON:-python3}
STAMP=$VENV/.spool-requirements
want=$(cat tests/requirements.txt tests/requirements-nodeps.txt | sha256sum | cut -d' ' -f1)

if [[ ! -x $VENV/bin/python3 ]]; then
  echo "test_env: creating $VENV with $($PY --version 2>&1)"
  $PY -m venv "$VENV" || {
    echo "test_env: cannot create a venv with $PY; on Debian: apt-get install python3-venv" >&2
    exit 1
  }
fi
if [[ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]]; then
  echo "test_env: installing tests/requirements.txt into $VENV (a few minutes the first time)"
  PIP="$VENV/bin/python3 -m pip install --quiet --disable-pip-version-check"
  $PIP --upgrade pip
  $PIP -r tests/requirements.txt
  $PIP --no-deps -r tests/requirements-nodeps.txt
  echo "$want" > "$STAMP"
fi

need=()
command -v prometheus >/dev/null && command -v promtool >/dev/null || need+=(prometheus)
command -v strace >/dev/null || need+=(strace)
command -v systemd-analyze >/dev/null || need+=(systemd)
if ((${#need[@]})); then
  SUDO=""
  if [[ $(id -u) -ne 0 ]]; then
    if sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
      echo "test_env: the tests need ${need[*]}; install them with:" >&2
      echo "  sudo apt-get install -y --no-install-recommends ${need[*]}" >&2
      exit 1
    fi
  fi
  echo "test_env: installing ${need[*]} with apt-get"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${need[@]}"
  # Only the binaries are wanted: the tests start their own on a loopback port.
  $SUDO systemctl disable --now prometheus >/dev/null 2>&1 || true
fi
echo "test_env: ready ($VENV, prometheus, strace, systemd-analyze)"

#!/usr/bin/env bash
# The system tools the tests drive, installed where missing (apt-get, as root). A tool that is
# missing and cannot be installed fails this script, so CI fails instead of passing with the
# tests that need it skipped. .ci/run runs it before the suite.
set -euo pipefail

need() {  # need <Debian package> <command>: install the package unless the command exists
  local pkg=$1 cmd=$2
  command -v "$cmd" >/dev/null 2>&1 && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    { apt-get install -y -qq "$pkg" \
      || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$pkg"; }; } >/dev/null 2>&1 || true
  fi
  if ! command -v "$cmd" >/dev/null 2>&1; then
    echo "ci_tools: \`$cmd\` (Debian package $pkg) is missing and could not be installed; the tests that drive it" \
         "would skip: install it (as root: apt-get install -y $pkg)" >&2
    exit 1
  fi
}

need iproute2 ip  # tests/test_multinode_ray.py builds a network namespace with `ip`
need zsh zsh      # tests/test_completions.py: the zsh, fish and tmux (driving an interactive zsh) tests
need fish fish
need tmux tmux

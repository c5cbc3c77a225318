#!/usr/bin/env bash
# Debian packages the test suite needs; installed once, idempotently.
set -euo pipefail
need=()
command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
# SIMDe headers: tests/test_kernels.py runs the AVX-512 kernels on CPUs without AVX-512 with them
[ -e /usr/include/simde/x86/avx512.h ] || need+=(libsimde-dev)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  else
    echo "setup_test: missing ${need[*]}; install them with apt-get (needs root)" >&2
  fi
fi

#!/usr/bin/env bash
# Debian packages the C extensions need to build (setup.py): OpenSSL's headers for the TCP data path's
# mutual TLS in C (wire/tcp_io.c). Installed once, idempotently; without root, says what to install.
set -euo pipefail
need=()
[ -e /usr/include/openssl/ssl.h ] || need+=(libssl-dev)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  else
    echo "setup_build: missing ${need[*]} (the C extensions link OpenSSL); install them with apt-get (needs root)" >&2
    exit 1
  fi
fi

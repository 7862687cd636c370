#!/usr/bin/env bash
# Installs the Debian packages `make test` needs when they are missing, and prints what it
# installed (or that nothing was missing):
#   postgresql                 the PostgreSQL store's tests and the cluster test run against a
#                              throwaway server (scripts/with-postgres.sh)
#   chromium fonts-liberation  the dashboard test drives headless Chromium (scripts/dashboard-test.sh)
# Runs apt-get as root, or through sudo when that is available; otherwise it fails naming the
# packages to install. Everything else `make test` needs (the model, the Python venvs of the
# client suites, moto) is fetched from the package index by the scripts that use it.
set -euo pipefail

missing=()
compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || missing+=(postgresql)
command -v chromium >/dev/null || missing+=(chromium fonts-liberation)

if [[ ${#missing[@]} -eq 0 ]]; then
    echo "system-deps: postgresql and chromium present, nothing to install"
    exit 0
fi

as_root=()
if [[ $(id -u) -ne 0 ]]; then
    if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
        as_root=(sudo -n)
    else
        echo "system-deps: missing ${missing[*]}; run as root (or with passwordless sudo):" >&2
        echo "  apt-get update && apt-get install -y --no-install-recommends ${missing[*]}" >&2
        exit 1
    fi
fi

echo "system-deps: installing ${missing[*]} (apt-get)"
"${as_root[@]}" apt-get update -qq
DEBIAN_FRONTEND=noninteractive "${as_root[@]}" apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
for pkg in "${missing[@]}"; do
    echo "system-deps: installed $pkg $(dpkg-query -W -f='${Version}' "$pkg")"
done

#!/usr/bin/env bash
# Runs CMD... with a throwaway PostgreSQL server: initdb's a cluster in a temporary directory,
# starts it on a Unix socket there (no TCP port, so runs never collide), exports
# TEMPER_TEST_POSTGRES_URL, runs CMD, then stops the server and deletes the cluster whatever CMD
# did. Exits with CMD's status.
#
#   scripts/with-postgres.sh cargo test --release -p temper-store --test store
#
# Needs Debian's `postgresql` package (the server binaries under /usr/lib/postgresql/<ver>/bin).
# PostgreSQL refuses to run as root: as root the cluster belongs to the `postgres` system user
# (the package creates it) and the commands run through runuser.
set -euo pipefail

if [[ $# -eq 0 ]]; then
    echo "usage: $0 CMD [ARGS...]" >&2
    exit 2
fi

bindir=""
for dir in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V -r); do
    if [[ -x "$dir/initdb" && -x "$dir/pg_ctl" ]]; then
        bindir=$dir
        break
    fi
done
if [[ -z "$bindir" ]] && command -v pg_config >/dev/null; then
    bindir=$(pg_config --bindir)
fi
if [[ -z "$bindir" || ! -x "$bindir/initdb" ]]; then
    echo "$0: no PostgreSQL server found (install Debian's postgresql package)" >&2
    exit 1
fi

tmp=$(mktemp -d "${TMPDIR:-/tmp}/temper-pg.XXXXXX")
as_owner=()
if [[ $(id -u) -eq 0 ]]; then
    chown postgres: "$tmp"
    as_owner=(runuser -u postgres --)
fi

cleanup() {
    if [[ -f "$tmp/data/postmaster.pid" ]]; then
        "${as_owner[@]}" "$bindir/pg_ctl" -D "$tmp/data" -m immediate -w stop >/dev/null 2>&1 || true
    fi
    rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# fsync off: the cluster is deleted afterwards, and it makes the many small test databases fast.
"${as_owner[@]}" "$bindir/initdb" -D "$tmp/data" -U temper --auth=trust -E UTF8 --locale=C \
    --no-sync >"$tmp/initdb.log" 2>&1 || {
    cat "$tmp/initdb.log" >&2
    exit 1
}
port=5432
# Each store test opens its own database and pool (and the crash tests leave pools open), in
# parallel: room for many connections.
"${as_owner[@]}" "$bindir/pg_ctl" -D "$tmp/data" -l "$tmp/server.log" -w -t 60 \
    -o "-c listen_addresses='' -k $tmp -p $port -c fsync=off -c max_connections=300" \
    start >/dev/null || {
    cat "$tmp/server.log" >&2
    exit 1
}

export TEMPER_TEST_POSTGRES_URL="postgres://temper@localhost:$port/postgres?host=$tmp"
echo "with-postgres: PostgreSQL $("$bindir/postgres" -V | awk '{print $3}') at $TEMPER_TEST_POSTGRES_URL" >&2
status=0
"$@" || status=$?
exit $status

#!/usr/bin/env bash
# Usage: scripts/with-s3.sh CMD [ARGS...]. Runs CMD beside a local S3-compatible server (moto, pinned
# in scripts/requirements-s3.txt, installed once into ${TEMPER_HOME:-~/.cache/temper}/s3-venv) on a
# free port of 127.0.0.1, with one bucket made, and the environment an S3 client needs to reach it:
#   TEMPER_TEST_S3_URL       s3://temper-test, that bucket (for whole servers: `--artifacts URL/PREFIX`)
#   TEMPER_TEST_S3_ENDPOINT  the server's URL (tests may make and delete buckets of their own there)
#   AWS_ENDPOINT_URL, AWS_ALLOW_HTTP, AWS_REGION, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY
# The server holds everything in memory and is stopped when CMD ends; CMD's status is returned.
set -euo pipefail
if [ $# -eq 0 ]; then
    echo "usage: $0 CMD [ARGS...]" >&2
    exit 2
fi
root="$(cd "$(dirname "$0")/.." && pwd)"
python=$("$root/scripts/pinned-venv.sh" "$root/scripts/requirements-s3.txt" s3-venv)
log=$(mktemp "${TMPDIR:-/tmp}/temper-moto.XXXXXX")
# Port 0: the OS picks a free port, which the server prints.
"$(dirname "$python")/moto_server" -H 127.0.0.1 -p 0 >"$log" 2>&1 &
moto=$!
stop() {
    kill "$moto" 2>/dev/null || true
    wait "$moto" 2>/dev/null || true
    rm -f "$log"
}
trap stop EXIT
endpoint=
for _ in $(seq 100); do
    endpoint=$(grep -o 'Running on http://127\.0\.0\.1:[0-9]*' "$log" | head -1 | sed 's/^Running on //') || true
    [ -n "$endpoint" ] && break
    if ! kill -0 "$moto" 2>/dev/null; then
        cat "$log" >&2
        echo "with-s3.sh: moto_server exited before listening" >&2
        exit 1
    fi
    sleep 0.1
done
if [ -z "$endpoint" ]; then
    cat "$log" >&2
    echo "with-s3.sh: moto_server did not listen within 10 s" >&2
    exit 1
fi
# moto takes bucket requests unsigned (a real S3 would not).
"$python" -c 'import sys, urllib.request
urllib.request.urlopen(urllib.request.Request(sys.argv[1], method="PUT"), timeout=10)' \
    "$endpoint/temper-test"
echo "with-s3.sh: moto S3 server at $endpoint, bucket s3://temper-test" >&2
export TEMPER_TEST_S3_URL=s3://temper-test
export TEMPER_TEST_S3_ENDPOINT="$endpoint"
export AWS_ENDPOINT_URL="$endpoint"
export AWS_ALLOW_HTTP=true
export AWS_REGION=us-east-1
# moto accepts any credentials; a client refuses to sign without some.
export AWS_ACCESS_KEY_ID=testing
export AWS_SECRET_ACCESS_KEY=testing
status=0
"$@" || status=$?
exit "$status"

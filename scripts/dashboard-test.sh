#!/usr/bin/env bash
# The dashboard test (scripts/dashboard_test.py) against the built `temper serve` on the default
# model, in Debian's headless `chromium`. Without chromium it is skipped with the reason, or fails
# when TEMPER_REQUIRE_CHROMIUM=1 (`make test` sets it; `.ci/run` installs chromium). Arguments go
# to the script (e.g. `--screenshot docs/dashboard.png`).
set -euo pipefail
cd "$(dirname "$0")/.."
chromium=$(command -v chromium || true)
if [ -z "$chromium" ]; then
    reason="chromium is not installed (apt-get install chromium)"
    if [ "${TEMPER_REQUIRE_CHROMIUM:-0}" = 1 ]; then
        echo "dashboard test FAILED: $reason, and TEMPER_REQUIRE_CHROMIUM=1"
        echo "test result: FAILED. 0 passed; 1 failed"
        exit 1
    fi
    echo "dashboard test skipped: $reason"
    exit 0
fi
exec python3 scripts/dashboard_test.py --chromium "$chromium" "$@"

#!/usr/bin/env bash
# Checks the OpenAPI document (crates/http/src/openapi.json, served at /openapi.json) against the
# OpenAPI 3.1 schema (tests/python/test_openapi_document.py); no server is needed. The validator
# lives in a pinned virtual environment outside the checkout (see scripts/pinned-venv.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
python=$(scripts/pinned-venv.sh tests/python/requirements-openapi.txt openapi-venv)
exec "$python" tests/python/test_openapi_document.py

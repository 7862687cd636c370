# Two entry points: `make serve` and `make test` (see README.md).

ARGS ?=

.PHONY: serve test fetch-model build

# Fetches (or reuses) the default model and prints its cached path.
fetch-model:
	scripts/fetch-model.sh

build:
	cargo build --release -p temper

serve: fetch-model build
	./target/release/temper serve $(ARGS)

# Tests that need the default model fail (not skip) without it.
test: fetch-model
	TEMPER_REQUIRE_MODEL=1 cargo test --release --workspace

# Two entry points: `make serve` and `make test` (see README.md).

ARGS ?=

.PHONY: serve test bench fetch-model build

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

# Throughput on the default model next to llama.cpp's figures (README, Benchmarks).
bench: fetch-model build
	./target/release/temper bench $(ARGS)

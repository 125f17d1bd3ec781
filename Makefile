# Two commands set everything up on a fresh machine:
#   make run    train the default model if none exists, export it, serve it on http://127.0.0.1:8000
#   make test   the test suite: all of it where CI is set (.ci/run), the tests not marked slow elsewhere
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
MODEL_DIR ?= models/default
ARTIFACT_DIR ?= artifacts/default
HOST ?= 127.0.0.1
PORT ?= 8000
EXPORT_FLAGS ?=

.PHONY: run test install train export serve clean

install: $(VENV)/.installed

# Re-install when the dependency list changes; the project itself is installed editable.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

run: export
	$(BIN)/python -m app --model-dir $(ARTIFACT_DIR) --host $(HOST) --port $(PORT)

train: $(MODEL_DIR)/model.safetensors
export: $(ARTIFACT_DIR)/manifest.json

# File targets: the model is trained only when missing (an interrupted run resumes from its last
# checkpoint), the artifact re-exported when the model or the artifact format changed.
$(MODEL_DIR)/model.safetensors: | install
	$(BIN)/python -m training.pretrain --out $(MODEL_DIR) --resume

$(ARTIFACT_DIR)/manifest.json: $(MODEL_DIR)/model.safetensors artifact/manifest.py | install
	$(BIN)/python -m export --model $(MODEL_DIR) --out $(ARTIFACT_DIR) $(EXPORT_FLAGS)

serve: | install
	$(BIN)/python -m app --model-dir $(ARTIFACT_DIR) --host $(HOST) --port $(PORT)

# Tests run in parallel, one process per core (pytest-xdist), each test module's tests together in one
# (their module-scoped servers and artifacts are made once). One file: .venv/bin/python -m pytest -q FILE
# Tests marked slow (the container build, installs from PyPI, the browser, fuzzing, real checkpoints) run
# where CI is set, as CI services and .ci/run set it, or with SLOW=1; elsewhere they are deselected.
SLOW ?= $(filter-out 0 false,$(CI))
test: install
	$(BIN)/python -m pytest -q -n auto --dist loadscope $(if $(SLOW),,-m "not slow")

clean:
	rm -rf $(VENV) .cache runs

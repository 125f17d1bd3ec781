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
# The ONNX Runtime build in .venv: cpu (onnxruntime) or gpu (onnxruntime-gpu in its place: never both, they
# install the same module). Given once (make install ONNXRUNTIME=gpu), it is kept in .venv for later runs.
ONNXRUNTIME_FILE := $(VENV)/.onnxruntime
ONNXRUNTIME ?= $(or $(shell cat $(ONNXRUNTIME_FILE) 2>/dev/null),cpu)
ifeq ($(filter cpu gpu,$(ONNXRUNTIME)),)
$(error ONNXRUNTIME is cpu or gpu, not "$(ONNXRUNTIME)")
endif
ORT_EXTRA := $(if $(filter gpu,$(ONNXRUNTIME)),gpu,serve)
ORT_OTHER := $(if $(filter gpu,$(ONNXRUNTIME)),onnxruntime,onnxruntime-gpu)

.PHONY: run test install train export serve clean FORCE

install: $(VENV)/.installed

# Re-install when the dependency list or the ONNX Runtime build changes; the project itself is installed
# editable. The dev extra installs the CPU onnxruntime; where the other build is there too (gpu chosen, or
# cpu chosen again), both are removed and the chosen one installed alone (the `serve` or `gpu` extra).
$(VENV)/.installed: pyproject.toml $(ONNXRUNTIME_FILE)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	if $(BIN)/python -m pip show -q $(ORT_OTHER) 2>/dev/null; then \
	  $(BIN)/python -m pip uninstall -q -y onnxruntime onnxruntime-gpu && \
	  $(BIN)/python -m pip install -q -e '.[$(ORT_EXTRA)]'; fi
	touch $@

# Written when missing or when the value given differs, so that what depends on it is remade only then
# (the file holding EXPORT_FLAGS below works the same way).
ifneq ($(ONNXRUNTIME),$(shell cat $(ONNXRUNTIME_FILE) 2>/dev/null))
$(ONNXRUNTIME_FILE): FORCE
endif
$(ONNXRUNTIME_FILE):
	@mkdir -p $(@D)
	echo '$(ONNXRUNTIME)' > $@

run: export
	$(BIN)/python -m app --model-dir $(ARTIFACT_DIR) --host $(HOST) --port $(PORT)

train: $(MODEL_DIR)/model.safetensors
export: $(ARTIFACT_DIR)/manifest.json

# File targets: the model is trained only when missing (an interrupted run resumes from its last
# checkpoint), the artifact re-exported when the model, the artifact format or EXPORT_FLAGS changed.
$(MODEL_DIR)/model.safetensors: | install
	$(BIN)/python -m training.pretrain --out $(MODEL_DIR) --resume

# The flags of the artifact's export, beside its folder (export replaces the folder whole). Given once
# (make run EXPORT_FLAGS="--device cuda"), they are kept for later runs; EXPORT_FLAGS= goes back to none.
EXPORT_FLAGS_FILE := $(patsubst %/,%,$(ARTIFACT_DIR)).export-flags
EXPORT_FLAGS ?= $(shell cat $(EXPORT_FLAGS_FILE) 2>/dev/null)
ifneq ($(strip $(EXPORT_FLAGS)),$(shell cat $(EXPORT_FLAGS_FILE) 2>/dev/null))
$(EXPORT_FLAGS_FILE): FORCE
endif
$(EXPORT_FLAGS_FILE):
	@mkdir -p $(@D)
	echo '$(strip $(EXPORT_FLAGS))' > $@

$(ARTIFACT_DIR)/manifest.json: $(MODEL_DIR)/model.safetensors artifact/manifest.py $(EXPORT_FLAGS_FILE) | install
	$(BIN)/python -m export --model $(MODEL_DIR) --out $(ARTIFACT_DIR) $(EXPORT_FLAGS)

serve: | install
	$(BIN)/python -m app --model-dir $(ARTIFACT_DIR) --host $(HOST) --port $(PORT)

# Tests run in parallel, one process per core (pytest-xdist), each test module's tests together in one
# (their module-scoped servers and artifacts are made once). One file: .venv/bin/python -m pytest -q FILE
# Tests marked slow (the container build, installs from PyPI, the browser, fuzzing, real checkpoints) run
# where CI is set, as CI services and .ci/run set it, or with SLOW=1; elsewhere they are deselected.
# SLOW=0 or SLOW=false leaves them out even where CI is set.
SLOW ?= $(CI)
RUN_SLOW := $(filter-out 0 false,$(SLOW))
test: install
	$(BIN)/python -m pytest -q -n auto --dist loadscope $(if $(RUN_SLOW),,-m "not slow")

clean:
	rm -rf $(VENV) .cache runs

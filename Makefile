# The two commands of the README are `make book` and `make test`; `make lab` opens the chapters.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install book lab learn test tangle check-tangle run-chapters bench clean

$(STAMP): requirements.txt pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -r requirements.txt
	$(VPY) -m pip install -q --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

## regenerate ds4ref/ from the chapters
tangle: $(STAMP)
	$(VPY) tools/tangle.py

check-tangle: $(STAMP)
	$(VPY) tools/tangle.py --check

## re-execute every chapter in place (stored outputs)
run-chapters: $(STAMP)
	$(VPY) tools/nb.py run book/[0-9][0-9]_*.ipynb book/[A-Z]_*.ipynb

## the main job: build the book offline (warnings are errors), English in _build/html/ and
## the Chinese edition in _build/html/zh/, then generate on the bundled model
## (a docstring model: --raw skips the chat template it never saw)
book: $(STAMP)
	$(VPY) tools/tangle.py --check
	$(VENV)/bin/jupyter-book build . -W -n --keep-going
	$(VPY) tools/zh.py build
	$(VPY) -m ds4ref --raw -p "Return a" -n 32 --temp 0

## open the chapters in JupyterLab; their kernel is .venv's Python, where ds4ref is installed
## (JUPYTER_PATH puts .venv's kernel spec before any other "python3" on this machine)
LAB_DIR ?= book
lab: $(STAMP)
	JUPYTER_PATH=$(CURDIR)/$(VENV)/share/jupyter $(VENV)/bin/jupyter-lab --notebook-dir=$(LAB_DIR) $(LAB_ARGS)

## build it yourself: a learner's notebook per core chapter in learn/ (stubs for each
## chapter's mechanism, generated from the chapter), opened in JupyterLab; check one with
## `.venv/bin/python tools/learn.py check 04`
learn: $(STAMP)
	$(VPY) tools/learn.py make
	$(MAKE) lab LAB_DIR=learn

## every test: unit and oracle tests, the drift check, and nbval over every chapter
test: $(STAMP)
	$(VPY) -m pytest -q

bench: $(STAMP)
	$(VPY) -m ds4ref.dev.bench all

clean:
	rm -rf _build

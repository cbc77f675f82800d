.PHONY: train test setup lint
train:  ## set up everything, then run the quickstart training job
	bash scripts/train.sh
test:   ## set up everything, then run the test suite
	bash scripts/test.sh
setup:
	bash scripts/setup.sh
lint:
	.venv/bin/ruff check .

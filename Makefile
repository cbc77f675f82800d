.PHONY: train test test-fast setup lint lab-sft-model
train:  ## set up everything, then run the main job: GRPO on the trained lab model (configs/lab_sft.yaml)
	bash scripts/train.sh
test:   ## set up everything, then run the whole test suite (slow lane included; what CI runs)
	bash scripts/test.sh
test-fast:  ## the same without the tests marked slow (for development)
	TIR_RL_TEST_FAST=1 bash scripts/test.sh
setup:
	bash scripts/setup.sh
lint:
	.venv/bin/ruff check .
lab-sft-model:  ## rebuild the shipped trained lab model (~20 min) and compare its weights
	bash scripts/build_lab_sft.sh

"""Environments for tool-using agents, registered with gymnasium under `tir_rl/...`."""

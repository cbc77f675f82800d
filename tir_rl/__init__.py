"""tir-rl: reinforcement learning of LLM agents that reason with tools over many turns."""

__version__ = "0.1.0"

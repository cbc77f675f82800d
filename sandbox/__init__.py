"""Sandboxed code execution for code tools (tir_rl.sandbox)."""

from tir_rl.sandbox.base import ExecResult, Sandbox

__all__ = ["ExecResult", "Sandbox"]

"""What `tir-rl sandbox build | check | clean` do (the CLI parses arguments and prints)."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from tir_rl.config import from_dict, merge, parse_overrides
from tir_rl.errors import ConfigError
from tir_rl.sandbox import Backend, SandboxConfig, configure, open_episode, shutdown

if TYPE_CHECKING:
    from tir_rl.sandbox.hostile import CaseReport

logger = logging.getLogger(__name__)


def load_sandbox_config(path: str | None, overrides: Sequence[str]) -> SandboxConfig:
    """The `sandbox:` section of a run config (optional) plus `--set` overrides within it."""
    data: dict = {}
    if path:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"Config file {file} does not exist.")
        loaded = yaml.safe_load(file.read_text()) or {}
        data = loaded.get("sandbox", {}) if isinstance(loaded, dict) else {}
    return from_dict(SandboxConfig, merge(data, parse_overrides(overrides)), where="sandbox")


def build(*, force: bool, packages: Sequence[str] | None) -> str:
    """Build the image (skipped when up to date) and return its tag."""
    from tir_rl.sandbox.image import ImageBuilder

    config = ImageBuilder.Config()
    if packages is not None:
        config.python_packages = tuple(packages)
    return ImageBuilder(config=config).build(force=force)


def check(
    config: SandboxConfig,
    *,
    include_slow: bool,
    names: Sequence[str],
    on_report: Callable[[CaseReport], None] | None = None,
) -> list[CaseReport]:
    """Run the hostile-input suite against the configured backend; return its reports.

    `on_report` gets each case's report as soon as it is done (the CLI prints a line).
    """
    from tir_rl.sandbox.hostile import CASES, run_suite

    unknown = set(names) - {c.name for c in CASES}
    if unknown:
        raise ConfigError(f"unknown case(s) {sorted(unknown)}; choose from "
                          f"{', '.join(c.name for c in CASES)}")
    configure(config)
    backend = config.backend
    grace = (config.docker if backend is Backend.DOCKER else config.bwrap).hard_grace_s
    try:
        return run_suite(
            lambda: open_episode(), grace_s=grace, include_slow=include_slow,
            names=list(names) or None, on_report=on_report,
        )
    finally:
        shutdown()


def clean(*, everything: bool) -> int:
    """Remove sandbox containers (all, or only those of dead runs) and stale cgroups."""
    from tir_rl.sandbox.docker import clean_containers, connect

    removed = 0
    if shutil.which("docker"):
        try:
            api = connect().api
        except Exception as exc:  # noqa: BLE001 - no engine means nothing to clean there
            logger.info("Docker engine not reachable (%s); skipping containers", exc)
        else:
            removed += clean_containers(api, own_run_id=None, everything=everything)
    for root in (Path("/sys/fs/cgroup"), *Path("/sys/fs/cgroup").glob("*")):
        parent = root / "tir-rl-sandbox"
        if parent.is_dir():
            for group in parent.iterdir():
                if group.is_dir():
                    try:
                        if not (group / "cgroup.procs").read_text().strip():
                            group.rmdir()
                            removed += 1
                    except OSError:
                        pass
    return removed

"""Configuration: dataclass config trees loaded from YAML plus `--set` overrides.

- `loading`: `load`, `dump`, `from_dict`, `to_dict`, `parse_overrides`, `merge`
  (re-exported here).
- `field_docs`: the docstring under each field of a dataclass, read from source.
- `reference`: a Markdown reference of a config tree, from those docstrings.

Nothing here knows a component: every component owns its nested keyword-only `Config`, and
`tir_rl.run_config` (with the entry points) composes them into the run's root config.
"""

from tir_rl.config.loading import dump, from_dict, load, merge, parse_overrides, to_dict

__all__ = ["dump", "from_dict", "load", "merge", "parse_overrides", "to_dict"]

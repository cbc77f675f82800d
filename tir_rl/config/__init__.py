"""Configuration: dataclass config trees loaded from YAML plus `--set` overrides.

- `loading`: the mechanism (`load`, `dump`, `from_dict`, `to_dict`, `parse_overrides`,
  `merge`), re-exported here. It knows no component: every component owns its nested
  keyword-only `Config` dataclass.
- `run`: `RunConfig`, the root config of `tir-rl train | eval | rollout | doctor`. It
  composes the components' `Config`s, so it sits with the entry points: import it as
  `tir_rl.config.run` (this package does not, so the loader stays below every component).
- `reference`: the generated configuration reference (`python -m tir_rl.config.reference`).
"""

from tir_rl.config.loading import dump, from_dict, load, merge, parse_overrides, to_dict

__all__ = ["dump", "from_dict", "load", "merge", "parse_overrides", "to_dict"]

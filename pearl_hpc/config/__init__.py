"""Config files: YAML readers (:mod:`.files`) and the one run config schema (:mod:`.run`).

Every failure is a :class:`~pearl_hpc.errors.ConfigError` whose one-line message names
the file, the field and the fix.
"""

from pearl_hpc.config.files import REPO_CONFIGS, load_policy, load_profile, load_yaml

__all__ = ["REPO_CONFIGS", "load_policy", "load_profile", "load_yaml"]

"""Makes verl-partial's config groups (``+backend=cpu``, ``+partial=default``, ...) visible to any Hydra app.

Hydra discovers this module through the ``hydra_plugins`` namespace package. The groups ship as
``verl_partial.hydra_configs`` (``hydra_configs/`` at the top of the source tree); when the package
is imported from a source checkout rather than an install, that directory is used directly.
Appending, not prepending, keeps every verl config authoritative: our groups have names verl does
not use.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

from verl_partial import hydra_resolvers

# Hydra imports this module while scanning plugins, i.e. before it composes a config using them.
hydra_resolvers.register()


def config_dir() -> Path:
    spec = importlib.util.find_spec("verl_partial.hydra_configs")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    package = importlib.util.find_spec("verl_partial")
    if package is None or package.origin is None:
        raise ImportError("verl_partial is not importable; install verl-partial")
    return Path(package.origin).resolve().parent.parent / "hydra_configs"


class VerlPartialSearchPathPlugin(SearchPathPlugin):
    """Appends our config dir; importing this module also registers the resolvers our groups use."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="verl-partial", path=f"file://{config_dir()}")

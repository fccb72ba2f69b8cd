"""Makes verl-partial's config groups (``+backend=cpu``, ``+partial=default``, ...) visible to any Hydra app.

Hydra discovers this module through the ``hydra_plugins`` namespace package; the groups live in
``verl_partial.hydra_configs`` (``hydra_configs/`` in the source tree). Appending, not prepending,
keeps every verl config authoritative: our groups have names verl does not use.
"""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

CONFIG_PACKAGE = "pkg://verl_partial.hydra_configs"


class VerlPartialSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="verl-partial", path=CONFIG_PACKAGE)

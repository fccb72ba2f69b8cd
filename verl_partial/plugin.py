"""Entry point of the ``verl.plugins`` group: verl imports this module in every process on ``import verl``.

verl logs plugin load errors at DEBUG level only, so a broken install would be silent. We warn at
load, and keep the error so that the first config that asks for one of our features fails with it.
"""

from __future__ import annotations

import logging
import warnings

LOAD_ERROR: BaseException | None = None


def register_with_hydra() -> None:
    """Our config groups and resolvers, whether or not Hydra's plugin scan finds ``hydra_plugins``.

    Hydra lists search-path plugins by walking the ``hydra_plugins`` namespace package's path. Under
    an editable install (setuptools' import-hook finder) that path holds only the finder's
    placeholder, which ``pkgutil`` cannot list, so the scan misses our plugin unless the checkout
    happens to be the working directory. verl imports this module before ``main_ppo``'s
    ``@hydra.main`` composes, so registering the plugin class here makes ``+partial=...`` work from
    any directory under any install.
    """
    from hydra.core.plugins import Plugins
    from hydra.plugins.search_path_plugin import SearchPathPlugin

    from hydra_plugins.verl_partial_searchpath.searchpath import VerlPartialSearchPathPlugin
    from verl_partial import hydra_resolvers

    hydra_resolvers.register()
    # Hydra's scan (run by the first Plugins.instance()) re-executes the plugin module, so when it found the plugin
    # its class is another object than ours: registering ours too would list our search path twice in every error.
    plugins = Plugins.instance()
    name = f"{VerlPartialSearchPathPlugin.__module__}.{VerlPartialSearchPathPlugin.__qualname__}"
    if not any(f"{found.__module__}.{found.__qualname__}" == name for found in plugins.discover(SearchPathPlugin)):
        plugins.register(VerlPartialSearchPathPlugin)


try:
    register_with_hydra()
    from verl_partial.patches import apply

    apply.install()
except Exception as error:  # noqa: BLE001 - any failure must surface, whatever its type
    LOAD_ERROR = error
    message = f"verl-partial failed to register with verl and is inactive: {error!r}"
    logging.getLogger("verl_partial").error(message)
    warnings.warn(message, RuntimeWarning, stacklevel=1)
    try:
        apply.install_failure_guard(error)
    except Exception:  # noqa: BLE001 - the warning above already reports the failure
        pass

"""Entry point of the ``verl.plugins`` group: verl imports this module in every process on ``import verl``.

verl logs plugin load errors at DEBUG level only, so a broken install would be silent. We warn at
load, and keep the error so that the first config that asks for one of our features fails with it.
"""

from __future__ import annotations

import logging
import warnings

LOAD_ERROR: BaseException | None = None

try:
    from verl_partial import verl_patches

    verl_patches.install()
except Exception as error:  # noqa: BLE001 - any failure must surface, whatever its type
    LOAD_ERROR = error
    message = f"verl-partial failed to register with verl and is inactive: {error!r}"
    logging.getLogger("verl_partial").error(message)
    warnings.warn(message, RuntimeWarning, stacklevel=1)
    try:
        verl_patches.install_failure_guard(error)
    except Exception:  # noqa: BLE001 - the warning above already reports the failure
        pass

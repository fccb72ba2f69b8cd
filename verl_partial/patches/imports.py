"""Patching a verl module when it is imported, in any process, without importing it ourselves."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.metadata
import sys
from collections.abc import Callable
from types import ModuleType


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``callback(module)`` right after ``module_name`` finishes executing, in any process."""

    def __init__(self, module_name: str, callback: Callable[[ModuleType], None]) -> None:
        self.module_name = module_name
        self.callback = callback
        # Several hooks may wait for one module (patches installed more than once in a process, e.g. by
        # tests): each asks the others for the spec, so a hook already searching must answer None, or two
        # hooks ask each other forever (RecursionError).
        self._searching = False

    def find_spec(self, fullname, path, target=None):
        if fullname != self.module_name or self._searching:
            return None
        self._searching = True
        try:
            for finder in sys.meta_path:
                if finder is self:
                    continue
                spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
                if spec is not None and spec.loader is not None:
                    spec.loader = _CallbackLoader(spec.loader, self.callback)
                    return spec
            return None
        finally:
            self._searching = False


class _CallbackLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, callback: Callable[[ModuleType], None]) -> None:
        self.loader = loader
        self.callback = callback

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        self.callback(module)


def after_import(module_name: str, callback: Callable[[ModuleType], None]) -> None:
    if module_name in sys.modules:
        callback(sys.modules[module_name])
    else:
        sys.meta_path.insert(0, _AfterImport(module_name, callback))

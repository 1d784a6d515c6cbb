"""Register ``strategy="mhc_parallel"`` with Lightning (Trainer and Fabric) once both packages
are imported.

Lightning finds the strategy by name only after ``lightning_mhc.lightning`` and
``lightning_mhc.fabric`` have run (they call the Trainer's and Fabric's registries). Yet
``import lightning_mhc`` must not import Lightning: the rooms below ``lightning_mhc.strategies``
(``recompute``, ``distributed``, ``model``, ``checkpoint``, ``parallelize`` ...) are used without it. So ``import lightning_mhc`` calls
:func:`register_with_lightning`, which

- imports ``lightning_mhc.lightning`` at once (registering the strategy) when
  ``lightning.pytorch`` is already imported, and otherwise
- installs a one-shot post-import hook: a ``sys.meta_path`` finder that lets the normal
  finders locate ``lightning`` and ``lightning.pytorch``, wraps their loaders'
  ``exec_module``, and, once the outermost of the two has finished executing, removes
  itself and imports ``lightning_mhc.fabric`` and ``lightning_mhc.lightning``.

Both import orders (``import lightning_mhc`` before or after ``import lightning.pytorch``,
or ``import lightning``) therefore end with the strategy registered, and importing a
lower layer alone never pulls Lightning in.
"""
from __future__ import annotations

import importlib
import sys
import warnings
from importlib.abc import MetaPathFinder

_WATCHED = ("lightning", "lightning.pytorch")
_INTEGRATIONS = ("lightning_mhc.fabric", "lightning_mhc.lightning")


def _initializing(name: str) -> bool:
    module = sys.modules.get(name)
    return getattr(getattr(module, "__spec__", None), "_initializing", False)


def _lightning_ready(just_executed: str | None = None) -> bool:
    """``lightning.pytorch`` is imported and neither it nor its parent is still executing
    (``just_executed``: a module whose ``exec_module`` has just returned)."""
    if "lightning.pytorch" not in sys.modules:
        return False
    return not any(_initializing(name) for name in _WATCHED if name != just_executed)


def _register() -> None:
    for integration in _INTEGRATIONS:
        if integration in sys.modules:  # imported, or being imported: it registers the strategy itself
            continue
        try:
            importlib.import_module(integration)
        except Exception as exc:  # a broken plugin must not break ``import lightning``
            warnings.warn(
                f"lightning_mhc could not register strategy 'mhc_parallel' with Lightning ({exc!r}); "
                f"`import {integration}` shows the error.",
                stacklevel=2,
            )


class _RegisterAfterLightningImport(MetaPathFinder):
    """Finds nothing itself: it wraps the loaders of ``lightning`` / ``lightning.pytorch``."""

    def __init__(self) -> None:
        self._searching: set[str] = set()

    def find_spec(self, fullname, path, target=None):
        if fullname not in _WATCHED or fullname in self._searching:
            return None
        self._searching.add(fullname)
        try:
            spec = self._find_with_other_finders(fullname, path, target)
        finally:
            self._searching.discard(fullname)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec  # nothing to wrap (namespace package or legacy loader): no hook this time
        try:
            _wrap_exec_module(loader, fullname, self)
        except AttributeError:  # a loader without an instance dict: nothing to hook
            pass
        return spec

    def _find_with_other_finders(self, fullname, path, target):
        for finder in list(sys.meta_path):
            find_spec = getattr(finder, "find_spec", None)
            if finder is self or find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return None

    def uninstall(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


def _wrap_exec_module(loader, fullname: str, finder: _RegisterAfterLightningImport) -> None:
    """Shadow ``loader.exec_module`` (an instance attribute, removed after one call)."""
    original = loader.exec_module

    def exec_module(module):
        if module.__name__ != fullname:  # a loader shared with other modules
            return original(module)
        try:
            original(module)
        finally:
            vars(loader).pop("exec_module", None)
        if _lightning_ready(just_executed=fullname):
            finder.uninstall()
            _register()

    loader.exec_module = exec_module


def register_with_lightning() -> None:
    """Register ``"mhc_parallel"`` now if Lightning is imported, else when it is."""
    if _lightning_ready():
        _register()
        return
    if not any(isinstance(f, _RegisterAfterLightningImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterLightningImport())

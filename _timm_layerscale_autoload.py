"""Register timm-layerscale's models whenever timm is imported, without ``import timm_layerscale``.

timm finds models only in its own registry, which is filled by importing the module that
defines them; it has no plugin discovery. This module closes that gap. Installation puts
two one-line start-up files next to it in site-packages, both calling :func:`install`:

* ``timm_layerscale.start`` holds the entry point ``_timm_layerscale_autoload:install``,
  which :mod:`site` runs on Pythons that implement PEP 829 (3.15 and later);
* ``timm_layerscale.pth`` holds ``import _timm_layerscale_autoload; _timm_layerscale_autoload.install()``
  for older Pythons. A PEP 829 Python skips the ``import`` lines of a ``.pth`` file that
  has a ``.start`` file of the same name, and :func:`install` is idempotent anyway.

:func:`install` only puts a finder at the front of :data:`sys.meta_path`; it imports
nothing, so interpreter start-up stays fast and a program that never imports timm is not
affected. The finder answers no question itself. When the top-level ``timm`` package is
looked up, it asks the other finders for the real spec and hooks that spec's loader, so
that once ``timm/__init__.py`` has run to its end ``timm_layerscale`` is imported, which
registers the models. By then every name timm defines exists, so the plugin's own
``import timm`` cannot form a cycle. The finder leaves :data:`sys.meta_path` as soon as timm
is executed (a mere lookup, such as ``importlib.util.find_spec("timm")``, keeps it).

This is a top-level module rather than part of the ``timm_layerscale`` package on purpose:
importing any submodule of the package runs the package's ``__init__`` (its public names,
the key rules and their tables), and interpreter start-up should load this one small file and
nothing more.

``TIMM_LAYERSCALE_AUTOLOAD=0`` (or ``false``, ``no``, ``off``) turns the hook off. A failure
while registering never breaks ``import timm``: it is reported in one ``RuntimeWarning``, the
names registered before the failure are removed again, and the plugin's half-imported
modules are dropped so that an explicit ``import timm_layerscale`` shows the full error.
"""

import os
import sys

ENV_VAR = "TIMM_LAYERSCALE_AUTOLOAD"
PLUGIN = "timm_layerscale"
MODELS = PLUGIN + ".models"  # importing it registers every model with timm
HOST = "timm"
_OFF_VALUES = ("0", "false", "no", "off")

_installed = False
_fired = False
_forced = False


def enabled() -> bool:
    """Whether the environment allows the hook (``TIMM_LAYERSCALE_AUTOLOAD`` is not off)."""
    return os.environ.get(ENV_VAR, "").strip().lower() not in _OFF_VALUES


def install(force: bool = False) -> None:
    """Arrange for the plugin to be imported right after timm (the start-up entry point).

    Safe to call any number of times. If timm is already fully imported, the models are
    registered at once; if it is being imported right now, nothing is done.

    Args:
        force: Install even when ``TIMM_LAYERSCALE_AUTOLOAD`` switches the hook off;
            ``import timm_layerscale`` uses it, since an explicit import always registers.
    """
    global _installed, _forced
    _forced = _forced or force
    if _installed or not _active():
        return
    _installed = True
    timm = sys.modules.get(HOST)
    if timm is None:
        sys.meta_path.insert(0, TimmImportWatcher)
    elif not getattr(getattr(timm, "__spec__", None), "_initializing", False):
        register()


class TimmImportWatcher:
    """Meta path finder that hooks the loader of the top-level ``timm`` package."""

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname != HOST or _fired:
            return None
        for finder in list(sys.meta_path):
            find_spec = getattr(finder, "find_spec", None)
            if finder is cls or find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                _hook_loader(spec.loader)
                return spec
        return None


def _hook_loader(loader) -> None:
    """Make ``loader.exec_module`` register the plugin after it has executed timm."""
    exec_module = getattr(loader, "exec_module", None)
    if exec_module is None:
        return

    def exec_module_then_register(module):
        if module.__name__ != HOST or _fired:
            return exec_module(module)
        _uninstall()
        if vars(loader).get("exec_module") is exec_module_then_register:
            del loader.exec_module
        exec_module(module)
        register()

    try:
        loader.exec_module = exec_module_then_register
    except (AttributeError, TypeError):
        pass


def _active() -> bool:
    return _forced or enabled()


def _uninstall() -> None:
    while TimmImportWatcher in sys.meta_path:
        sys.meta_path.remove(TimmImportWatcher)


def register() -> None:
    """Import the plugin once; on failure warn, undo its registrations and continue."""
    global _fired
    if _fired:
        return
    _fired = True
    _uninstall()
    if not _active() or MODELS in sys.modules:
        return
    modules_before = set(sys.modules)
    names_before = _registered_names()
    try:
        __import__(MODELS)
    except Exception as exc:
        _undo(modules_before, names_before)
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
        message = (
            f"timm-layerscale models are not registered with timm ({reason}). "
            f"'import {PLUGIN}' shows the full error; {ENV_VAR}=0 turns this hook off."
        )
        import warnings

        try:
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        except Exception:  # warnings made errors (-W error) must not break `import timm` either
            sys.stderr.write(f"RuntimeWarning: {message}\n")


def _registered_names():
    registry = sys.modules.get("timm.models._registry")
    return set(getattr(registry, "_model_entrypoints", ()))


def _undo(modules_before, names_before) -> None:
    """Forget the plugin's modules and the timm names registered since ``names_before``."""
    for name in set(sys.modules) - modules_before:
        if name == PLUGIN or name.startswith(PLUGIN + "."):
            del sys.modules[name]
    registry = sys.modules.get("timm.models._registry")
    if registry is None:
        return
    try:
        for name in _registered_names() - names_before:
            for tagged in [name, *registry._model_with_tags.pop(name, ())]:
                registry._model_pretrained_cfgs.pop(tagged, None)
                registry._model_has_pretrained.discard(tagged)
            module = registry._model_to_module.pop(name, None)
            members = registry._module_to_models.get(module)
            if members is not None:
                members.discard(name)
                if not members:
                    del registry._module_to_models[module]
            registry._model_entrypoints.pop(name, None)
            registry._model_default_cfgs.pop(name, None)
            registry._deprecated_models.pop(name, None)
    except Exception:  # a timm whose registry looks different keeps what it has
        pass

"""Triton's interpreter (``TRITON_INTERPRET=1``: the suite runs the kernels on CPU tensors) patches
``triton.language`` for every launch, and again for every call of a ``@triton.jit`` helper inside
the kernel (``InterpretedFunction.__call__`` -> ``_patch_lang``): each such call walks the
language's modules with ``inspect.getmembers`` to patch again what the launch already patched (and
its own patches are never restored): 6,264 helper calls in the 84 launches of one run of the
Triton model test's three steps (Triton 3.9), whose CPU this cuts from 21.4 s to 14.4 s. Importing this module (tests/conftest.py, and
the fork server's preload, so forked ranks have it too) patches each language module once a
launch: a helper call whose globals hold only language modules patched in this launch (by the
kernel's launch, ``tl``; or by the first helper that saw another, ``triton.language``'s own
``tl.sum`` seeing ``tl.core``) patches nothing (``_patch_lang`` depends on its function through
those modules alone), and the helpers' patches are undone with the launch's at its end. Nothing
without ``TRITON_INTERPRET=1`` or without Triton."""
from __future__ import annotations

import os


def patch_the_language_once_per_launch() -> None:
    """Wrap ``triton.runtime.interpreter._patch_lang`` as the module's doc says (idempotent)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    if getattr(interpreter._patch_lang, "once_per_launch", False):
        return
    original = interpreter._patch_lang
    language = (interpreter.tl, interpreter.tl.core)
    running: list = []  # the running launch's (language modules patched, helpers' scopes); launches do not nest

    def languages(fn) -> set[int]:
        """What ``_patch_lang(fn)`` patches depends on ``fn`` only through these: the language
        modules its globals hold."""
        return {id(value) for value in fn.__globals__.values() if any(value is lang for lang in language)}

    def patch_lang(fn):
        if not running:  # a launch (GridExecutor): patched as ever, restored at its end with its helpers' patches
            scope = original(fn)
            entry = (languages(fn), [])
            running.append(entry)
            restore = scope.restore

            def restore_launch() -> None:
                running.remove(entry)
                for helper in reversed(entry[1]):
                    helper.restore()
                restore()

            scope.restore = restore_launch
            return scope
        patched, helpers = running[0]
        wanted = languages(fn)
        if wanted <= patched:  # patched already in this launch
            return interpreter._LangPatchScope()
        scope = original(fn)  # the first helper seeing another language module (tl.sum's tl.core): patched
        helpers.append(scope)
        patched |= wanted
        return scope

    patch_lang.once_per_launch, patch_lang.original = True, original  # (the original: for its test)
    interpreter._patch_lang = patch_lang


patch_the_language_once_per_launch()

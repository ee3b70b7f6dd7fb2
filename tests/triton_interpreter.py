"""Triton's interpreter (the kernels' tests on a CPU machine) without its per-call re-patching.

Under ``TRITON_INTERPRET=1`` every launch (``GridExecutor.__call__``) patches ``triton.language`` for
the interpreter (``_patch_lang``) and restores it when the grid is done. Every call of a ``@triton.jit``
helper inside the kernel (``InterpretedFunction.__call__``) runs ``_patch_lang`` once more: a walk over
every member of the language modules (``inspect.getmembers``) that, inside a launch, finds each builtin
already patched and sets the other attributes to equivalent values again (a helper of
``triton.language.standard``, ``tl.zeros`` say, sees ``triton.language.core`` too: its first call in a
launch patches that module, and the patches stay for the rest of the launch). The kernels here call
helpers thousands of times a launch; that walk was a third to two fifths of
the kernel tests' time.

:func:`skip_repatching_inside_a_launch` skips it for a helper whose language modules the running
launch (or a helper before it in that launch) has patched already; a helper that sees another one,
or a call outside any launch, is patched as before. What the interpreter computes is unchanged: the
same patched builtins are in effect. Only Triton 3.6's interpreter is touched (the version
pyproject.toml pins); with any other it does nothing.
"""

from __future__ import annotations

import inspect
import threading

PATCHED_VERSION = "3.6.0"


def skip_repatching_inside_a_launch() -> bool:
    """Installs the skip; False (nothing changed) when triton is not the pinned version or its
    interpreter does not look as expected."""
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    grid_executor = getattr(interpreter, "GridExecutor", None)
    function = getattr(interpreter, "InterpretedFunction", None)
    if (triton.__version__ != PATCHED_VERSION or grid_executor is None or function is None
            or not hasattr(interpreter, "_patch_lang") or not hasattr(interpreter, "InterpreterError")
            or getattr(grid_executor.__call__, "_voxring_tests", False)):
        return False
    langs = (tl, tl.core)
    running = threading.local()  # per thread: the language modules of the launches running

    known: dict[object, frozenset[int]] = {}

    def langs_of(fn) -> frozenset[int]:
        # the modules _patch_lang patches for fn: triton.language and triton.language.core
        if fn not in known:
            known[fn] = frozenset(id(value) for value in fn.__globals__.values()
                                  if inspect.ismodule(value) and value in langs)
        return known[fn]

    real_grid_call = grid_executor.__call__

    def grid_call(self, *args, **kwargs):
        stack = running.__dict__.setdefault("stack", [])
        stack.append(set(langs_of(self.fn)))  # the launch patches these before it runs the kernel
        try:
            return real_grid_call(self, *args, **kwargs)
        finally:
            stack.pop()

    def device_call(self, *args, **kwargs):
        # InterpretedFunction.__call__ of Triton 3.6, _patch_lang skipped where it would change nothing
        stack = running.__dict__.get("stack")
        needs = langs_of(self.fn)
        if not stack or not needs <= stack[-1]:
            interpreter._patch_lang(self.fn)  # its patches stay until the launch restores its own
            if stack:
                stack[-1] |= needs
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    grid_call._voxring_tests = True
    grid_executor.__call__ = grid_call
    function.__call__ = device_call
    return True

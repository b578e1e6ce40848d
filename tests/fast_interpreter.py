"""Triton's interpreter with two of its costs taken out, for the suite's CPU runs of the kernels.

Under TRITON_INTERPRET=1 every operation of a kernel runs through Python, and two costs come on top
of the operations themselves:
- Each call of one @triton.jit function from another patches triton.language's builtins to their
  numpy forms again: it lists the members of tl, tl.tensor and tl.math and finds them patched
  already by the launch. `install` replaces that call by a plain call of the rewritten function,
  which gives the same result, since every kernel module reaches the patched members through the
  one `triton.language` module (a function whose module holds `triton.language.core` itself keeps
  the original call).
- Every integer add, subtract and multiply on fewer than 64 bits is done again in int64 and
  compared with the type's range, and the result is dropped: outside Triton's debug mode a failed
  check raises nothing (as in a compiled kernel, which wraps). `install` turns the checks off;
  `overflow_checks(True)` turns them on together with the debug mode, so that an overflow raises,
  for the tests whose keys or indices come near the int32 range.
Together they take about a third off an interpreted launch. The replacement applies only to the
Triton version it was written against; under any other the interpreter runs as it ships.
"""
import dataclasses
import inspect

WRITTEN_FOR = "3.9."


def install():
    """Installs both changes once; returns whether it did."""
    try:
        import triton
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:  # (no triton: its tests skip)
        return False
    if not triton.__version__.startswith(WRITTEN_FOR):
        return False
    original = interpreter.InterpretedFunction.__call__
    if getattr(original, "skips_patching", False):
        return True
    expected = "_patch_lang(self.fn)\n        fn = self.rewrite()\n        try:\n            return fn(*args, **kwargs)"
    if expected not in inspect.getsource(original):  # (the call is no longer the one replaced here)
        return False
    reaches_core = {}

    def call(self, *args, **kwargs):
        if self.fn not in reaches_core:
            reaches_core[self.fn] = any(value is tl.core for value in self.fn.__globals__.values())
        if reaches_core[self.fn]:
            return original(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    call.skips_patching = True
    interpreter.InterpretedFunction.__call__ = call
    overflow_checks(False)
    return True


def overflow_checks(on):
    """Turns the interpreter's integer overflow checks on (the checks, and the debug mode that makes a
    failed one raise) or off; returns the options before, for `restore`."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    before = builder.options
    builder.options = dataclasses.replace(before, sanitize_overflow=on, debug=on)
    return before


def restore(options):
    from triton.runtime import interpreter

    interpreter.interpreter_builder.options = options

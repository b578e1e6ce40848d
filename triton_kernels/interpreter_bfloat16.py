"""Triton's interpreter with a GPU's bfloat16, for the kernels' runs on CPU tensors (TRITON_INTERPRET=1:
the tests, and a user's debugging), installed by launcher.py when the interpreter runs them.

The interpreter keeps bfloat16 values as their 16-bit patterns (numpy has no bfloat16), and two of its
operations get them wrong:
- a cast from float32 to bfloat16 drops the low 16 bits, rounding toward zero, where a GPU rounds to
  nearest even: a kernel's unit rows come out up to a unit in the last place low, which beta = 50
  turns into gradients percents off;
- tl.dot multiplies the patterns as integers.
`install` makes both what a GPU computes, for the whole process: the cast rounds to nearest even (a
NaN stays a NaN) unless it asks for round-toward-zero, and tl.dot takes the bfloat16 values, whose
products float32 holds exactly, summed in float32. Other arithmetic on bfloat16 values (+, *,
comparisons) still works on the patterns: the kernels do none (their bfloat16 tiles go only into
tl.dot, transposes and stores, and everything else is cast to float32 first), which a new kernel must
keep to. Written against Triton 3.9's interpreter; one whose two functions have other signatures is
left as it ships, `install` says so, and the triton backend refuses bfloat16 there.
"""
import inspect

import numpy as np

_CONVERT = ["input", "input_dtype", "output_dtype", "rounding_mode"]  # (the replaced functions' parameters)
_DOT = ["self", "a", "b", "d", "input_precision", "max_num_imprecise_acc"]


def install():
    """Installs both changes once; returns whether they are in place (None without Triton)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:  # (no triton: its tests skip)
        return None
    convert, dot = getattr(interpreter, "_convert_float", None), interpreter.InterpreterBuilder.create_dot
    nearest = (None, interpreter._ir.ROUNDING_MODE.RTNE)  # (a cast that asks for round-toward-zero gets it)
    if getattr(convert, "rounds_bfloat16", False):
        return True
    if convert is None or list(inspect.signature(convert).parameters) != _CONVERT or \
            list(inspect.signature(dot).parameters) != _DOT:
        return False

    def convert_float(data, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16 and rounding_mode in nearest:
            return bfloat16_bits(data)
        return convert(data, input_dtype, output_dtype, rounding_mode)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a, b = (interpreter.TensorHandle(bfloat16_values(t.data), tl.float32) if t.dtype == tl.bfloat16 else t
                for t in (a, b))
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    convert_float.rounds_bfloat16 = True
    interpreter._convert_float = convert_float  # (cast_impl and create_fp_to_fp call it by this name)
    interpreter.InterpreterBuilder.create_dot = create_dot
    return True


def bfloat16_bits(values):
    """The bfloat16 patterns (uint16) of float32 `values`, rounded to nearest even; NaN stays a quiet NaN
    of its sign, a value past bfloat16's range rounds to an infinity."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    bits = values.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(values)
    rounded[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)
    return rounded


def bfloat16_values(bits):
    """float32 values of bfloat16 patterns (uint16): exact."""
    return (np.ascontiguousarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)

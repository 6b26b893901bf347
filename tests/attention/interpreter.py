"""Run Triton kernels on CPU tensors through Triton's interpreter, with four fixes to triton
3.6's interpreter that the compiled kernels do not need:

- scalars are 1-element arrays that it turns into ints with int(), which numpy 2.4 refuses, so
  `range(start, end)` over loaded bounds fails (triton-lang/triton#9171, fixed upstream by
  taking the element first);
- `tl.dot` multiplies bfloat16 blocks as their raw uint16 bits; a bfloat16 widens to float32
  exactly, so the fix multiplies the widened values (products are exact in float32, as in a
  bf16 MMA with float32 accumulation);
- a float32 cast to bfloat16 truncates, where CUDA and torch round to nearest even; the fix
  rounds;
- a reduction whose combine function is not one of a few named ones runs element by element
  in Python, which makes `tl.sort` (its xor_sum) take seconds; the fix reduces xor with numpy."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # read when triton is first imported

import numpy as np  # noqa: E402
import triton.language as tl  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402

_patch_lang_tensor = interpreter._patch_lang_tensor
_create_dot = interpreter.InterpreterBuilder.create_dot
_cast = interpreter.InterpreterBuilder.cast_impl
_reduce = interpreter.ReduceOps.apply_impl


def _index_scalars(tensor, scope) -> None:
    _patch_lang_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


def _widen_bf16(h: interpreter.TensorHandle) -> interpreter.TensorHandle:
    if h.dtype != tl.bfloat16:
        return h
    bits = h.data.astype(np.uint32) << 16
    return interpreter.TensorHandle(bits.view(np.float32), tl.float32)


def _dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    return _create_dot(self, _widen_bf16(a), _widen_bf16(b), d, input_precision,
                       max_num_imprecise_acc)


interpreter._patch_lang_tensor = _index_scalars
interpreter.InterpreterBuilder.create_dot = _dot


def _cast_rounding(self, src, dst_type):
    if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
        bits = src.data.astype(np.float32).view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # to nearest, ties to even
        return interpreter.TensorHandle(rounded.astype(np.uint16), tl.bfloat16)
    return _cast(self, src, dst_type)


interpreter.InterpreterBuilder.cast_impl = _cast_rounding


def _reduce_xor_with_numpy(self, input):
    if self.combine_fn != tl.standard._xor_combine:
        return _reduce(self, input)
    xor = np.bitwise_xor.reduce(input[0].handle.data, axis=self.axis, keepdims=self.keep_dims)
    return self.to_tensor(xor, input[0].dtype)


interpreter.ReduceOps.apply_impl = _reduce_xor_with_numpy

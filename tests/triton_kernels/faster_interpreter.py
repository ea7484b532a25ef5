"""Triton's interpreter (``TRITON_INTERPRET=1``) made cheaper per operation, for the check scripts
of this folder: the same kernels, the same operations on the same numpy arrays, the same checks.

The interpreter runs a kernel's Python, and each ``tl`` operation goes through Triton's frontend
(type checks, casts, broadcasts), then a numpy call on the block. On the blocks of these checks
(32 to 1,024 elements) the frontend is the time, not numpy: 25-35 us an operation, most of it
building objects that describe the same few shapes over and over. Profiled on the three check
scripts (triton 3.6.0), where the time went, and what each patch does instead (each gives what
the function it replaces gives, and leaves any other case to it):

- ``tensor.__init__`` builds ``shape`` as a ``tl.tuple`` whose ``tuple_type`` it derives from
  the values each time (a million in a run of the decoder's check): made once per shape.
- ``block_type.__init__`` unwraps and validates its shape each time: once per shape.
- ``_get_np_dtype`` builds a dict of 13 types at each call: a lookup.
- Each call of a ``@triton.jit`` function inside a kernel (the encoder's ``_cells``, ``tl.max``)
  patches ``triton.language`` again (``_patch_lang``, 2 ms: a quarter of the encoder's check):
  skipped where the running launch has patched the same modules already.
- ``binary_op_type_checking_impl`` and ``broadcast_impl_value`` walk promotion, casts and
  shapes to return their operands as they are when both are integer tensors of one type (or
  blocks of one shape): they return them at once.
- The overflow check of ``+``, ``-`` and ``*`` on integers narrower than 64 bits
  (``sanitize_overflow``) widens both sides to int64 and compares the result with the type's
  range in six more frontend operations, for a ``device_assert`` that the interpreter's options
  (``debug`` off, always) drop: all of it computed and thrown away. Skipped while debug is off;
  an overflow raised nothing before either (an int32 ``x + x`` of 2^30 + 1 wraps in both).

Only for the version these patches were read from (``PATCHED_FOR``); with another, the
interpreter runs as it is (slower, the same results). ``LAYERTAP_PLAIN_INTERPRETER=1`` leaves it
unpatched too, to compare."""

from __future__ import annotations

import math
import os

PATCHED_FOR = "3.6.0"


def install() -> bool:
    """Patches the interpreter's frontend in this process; whether it did."""
    import triton

    if triton.__version__ != PATCHED_FOR or os.environ.get("LAYERTAP_PLAIN_INTERPRETER") == "1":
        return False
    from triton.language import core, semantic
    from triton.runtime import interpreter

    _patch_types(core)
    _patch_np_dtype(interpreter)
    _patch_device_calls(interpreter)
    _patch_semantic(semantic.TritonSemantic, core)
    return True


def _ints(shape) -> tuple | None:
    """``shape`` as a plain tuple of ints, if it is a list, tuple or ``tl.tuple`` of ints."""
    values = getattr(shape, "values", shape)
    if isinstance(values, (list, tuple)) and all(type(s) is int for s in values):
        return tuple(values)
    return None


def _patch_types(core) -> None:
    #: shape -> (its tuple_type, its sizes as constexprs, its element count as a constexpr)
    shapes: dict = {}
    block_numels: dict = {}
    tl_tuple, constexpr, tuple_type, constexpr_type = core.tuple, core.constexpr, core.tuple_type, core.constexpr_type
    original_tensor_init = core.tensor.__init__
    original_block_init = core.block_type.__init__

    def known_shape(key: tuple):
        got = shapes.get(key)
        if got is None and _ints(key) is not None:  # what tl.tuple derives from the same values
            got = shapes[key] = (
                tuple_type([constexpr_type(s) for s in key]),
                [constexpr(s) for s in key],
                constexpr(math.prod(key)),
            )
        return got

    def tensor_init(self, handle, type):
        values = getattr(type.shape, "values", None) if type.is_block() else []
        got = known_shape(tuple(values)) if isinstance(values, list) else None
        if got is None:
            return original_tensor_init(self, handle, type)
        self.handle = handle
        self.numel = got[2]
        self.type = type
        self.dtype = type.scalar
        self.shape = tl_tuple(list(got[1]), got[0])

    def block_init(self, element_ty, shape):
        values = getattr(shape, "values", shape)
        key = tuple(values) if isinstance(values, (list, tuple)) else None
        numel = block_numels.get(key) if key is not None else None
        if numel is None:
            original_block_init(self, element_ty, shape)
            key = _ints(self.shape)
            if key is not None and known_shape(key) is not None:
                block_numels[key] = self.numel
            return
        self.element_ty = element_ty
        self.shape = tl_tuple(list(key), shapes[key][0])  # a tl.tuple of ints, as the original makes
        self.numel = numel
        self.name = f"<{self.shape}, {element_ty}>"

    core.tensor.__init__ = tensor_init
    core.block_type.__init__ = block_init


def _patch_device_calls(interpreter) -> None:
    """A kernel's launch patches ``triton.language`` for the interpreter (``_patch_lang``), and
    so does each call of a ``@triton.jit`` function from the kernel (``_cells``, ``tl.max``),
    with the same builder, thousands of times a launch; a call's patches are never undone (the
    launch restores what it patched). Inside a launch, a call whose function sees only modules
    already patched in it skips patching them again."""
    import inspect

    original = interpreter._patch_lang
    tl = interpreter.tl
    launch: dict = {"langs": None}  # the modules the running launch patched

    class Patched:
        def restore(self) -> None:
            pass

    langs_of: dict = {}  # function -> the modules its _patch_lang patches

    def patch_lang(fn):
        langs = langs_of.get(fn)
        if langs is None:
            langs = langs_of[fn] = frozenset(
                id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)
            )
        if launch["langs"] is not None and langs <= launch["langs"]:
            return Patched()
        scope = original(fn)
        if launch["langs"] is not None:  # a call that patched more (``tl.core``): left so, as before
            launch["langs"] |= langs
            return scope
        launch["langs"] = langs  # a launch: its modules, until it restores them
        restore = scope.restore

        def restore_and_end() -> None:
            launch["langs"] = None
            restore()

        scope.restore = restore_and_end
        return scope

    interpreter._patch_lang = patch_lang


def _patch_np_dtype(interpreter) -> None:
    original = interpreter._get_np_dtype
    known: dict = {}

    def get_np_dtype(tt_dtype):
        try:
            return known[tt_dtype]
        except (KeyError, TypeError):
            pass
        got = original(tt_dtype)
        try:
            known[tt_dtype] = got
        except TypeError:
            pass
        return got

    interpreter._get_np_dtype = get_np_dtype


def _patch_semantic(semantic, core) -> None:
    original_broadcast = semantic.broadcast_impl_value

    def broadcast_impl_value(self, lhs, rhs):
        lhs_ty, rhs_ty = lhs.type, rhs.type
        if lhs_ty.is_block() and rhs_ty.is_block():
            shape = _ints(lhs_ty.get_block_shapes())
            if shape is not None and shape == _ints(rhs_ty.get_block_shapes()):
                return lhs, rhs
        return original_broadcast(self, lhs, rhs)

    semantic.broadcast_impl_value = broadcast_impl_value

    original_type_checking = semantic.binary_op_type_checking_impl
    tensor = core.tensor

    def binary_op_type_checking_impl(self, lhs, rhs, *args, **kwargs):
        # two integer tensors of one type and shape: no promotion, cast or broadcast to make
        if type(lhs) is tensor and type(rhs) is tensor:
            lhs_ty, rhs_ty = lhs.type, rhs.type
            scalar = lhs_ty.scalar
            if scalar.is_int() and scalar == rhs_ty.scalar and lhs_ty.is_block() == rhs_ty.is_block():
                if not lhs_ty.is_block():
                    return lhs, rhs
                shape = _ints(lhs_ty.get_block_shapes())
                if shape is not None and shape == _ints(rhs_ty.get_block_shapes()):
                    return lhs, rhs
        return original_type_checking(self, lhs, rhs, *args, **kwargs)

    semantic.binary_op_type_checking_impl = binary_op_type_checking_impl

    original_sanitize = semantic.binary_op_sanitize_overflow_impl

    def sanitize_overflow(self, lhs, rhs, binary_op):
        if self.builder.options.debug:  # else its device_assert is dropped: nothing to compute
            return original_sanitize(self, lhs, rhs, binary_op)

    semantic.binary_op_sanitize_overflow_impl = sanitize_overflow

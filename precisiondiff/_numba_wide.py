"""The one numba intrinsic both kernel modules share (imported only by them: it imports numba).

``_wide()`` at the top of a compiled function marks it ``"prefer-vector-width"="512"``: x86 tunes
for 256-bit vectors by default, and the kernels' 64-bit integer work (the fingerprint's
``vpmullq``, the compare tile's maxima on bit patterns) runs about twice as fast in 512-bit
vectors. A no-op where 512-bit vectors do not exist.
"""
from numba import types
from numba.extending import intrinsic

__all__ = ["wide"]


@intrinsic
def wide(typingctx):  # pragma: no cover - compiled
    """Mark the calling function ``"prefer-vector-width"="512"``. llvmlite only admits a fixed
    list of attribute names, hence ``set.add``."""
    def codegen(context, builder, sig, args):
        try:
            set.add(builder.function.attributes, '"prefer-vector-width"="512"')
        except Exception:  # noqa: BLE001 - another llvmlite: LLVM's default vector width
            pass
        return context.get_dummy_value()
    return types.none(), codegen

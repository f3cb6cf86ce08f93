"""Op classes: which budget row an ATen op, a custom op or an nn.Module class falls in."""
from __future__ import annotations

__all__ = ["OP_CLASSES", "op_class"]

OP_CLASSES = ("elementwise", "reduction", "matmul", "normalization", "softmax", "unknown")

_MATMUL = {
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "dot", "vdot", "mv",
    "addmv", "einsum", "tensordot", "_scaled_mm", "convolution", "_convolution", "conv1d",
    "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "cudnn_convolution", "mkldnn_convolution", "convolution_backward",
    "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_attention_math",
    "Linear", "LazyLinear", "Bilinear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d",
    "ConvTranspose2d", "ConvTranspose3d", "MultiheadAttention",
}
_REDUCTION = {
    "sum", "nansum", "mean", "nanmean", "prod", "cumsum", "cumprod", "var", "std", "var_mean",
    "std_mean", "norm", "linalg_vector_norm", "logsumexp", "avg_pool1d", "avg_pool2d",
    "avg_pool3d", "_adaptive_avg_pool2d", "adaptive_avg_pool2d", "embedding_bag",
    "_embedding_bag", "index_add", "scatter_add", "scatter_reduce", "trace",
    # scatter-adds of gradients: a sum per row of the weight
    "embedding_dense_backward", "embedding_backward", "_embedding_bag_backward",
    "_embedding_bag_dense_backward",
    "AvgPool1d", "AvgPool2d", "AvgPool3d", "AdaptiveAvgPool1d", "AdaptiveAvgPool2d",
    "AdaptiveAvgPool3d", "EmbeddingBag",
}
_NORMALIZATION = {
    "native_layer_norm", "layer_norm", "native_group_norm", "group_norm", "native_batch_norm",
    "batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
    "instance_norm", "rms_norm", "_fused_rms_norm", "LayerNorm", "GroupNorm", "BatchNorm1d",
    "BatchNorm2d", "BatchNorm3d", "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d",
    "RMSNorm", "LocalResponseNorm",
}
_SOFTMAX = {
    "_softmax", "softmax", "_log_softmax", "log_softmax", "_safe_softmax", "softmin",
    "Softmax", "LogSoftmax", "Softmin", "Softmax2d",
}
_ELEMENTWISE = {
    "add", "sub", "rsub", "mul", "div", "neg", "abs", "pow", "sqrt", "rsqrt", "exp", "exp2",
    "expm1", "log", "log2", "log10", "log1p", "sin", "cos", "tan", "tanh", "sigmoid", "erf",
    "erfc", "gelu", "relu", "silu", "mish", "elu", "leaky_relu", "hardtanh", "hardswish",
    "hardsigmoid", "softplus", "clamp", "clamp_min", "clamp_max", "where", "maximum",
    "minimum", "reciprocal", "square", "lerp", "addcmul", "addcdiv", "sign", "floor", "ceil",
    "round", "trunc", "fmod", "remainder", "_to_copy", "to", "clone", "copy", "view",
    "reshape", "t", "transpose", "permute", "expand", "cat", "stack", "slice", "select",
    "index", "index_select", "gather", "embedding", "dropout", "native_dropout",
    "masked_fill", "fill", "zeros_like", "ones_like", "contiguous", "unsqueeze", "squeeze",
    "split", "chunk", "flatten", "_unsafe_view", "alias", "detach",
    "ReLU", "GELU", "SiLU", "Mish", "ELU", "LeakyReLU", "Tanh", "Sigmoid", "Hardswish",
    "Hardtanh", "Softplus", "Dropout", "Identity", "Embedding", "Flatten",
}
_TABLES = (
    ("matmul", _MATMUL),
    ("reduction", _REDUCTION),
    ("normalization", _NORMALIZATION),
    ("softmax", _SOFTMAX),
    ("elementwise", _ELEMENTWISE),
)


def _base_name(name: str) -> str:
    n = name.strip()
    for prefix in ("torch.ops.aten.", "aten::", "aten."):
        if n.startswith(prefix):
            return n[len(prefix):].split(".")[0]
    if "." in n:  # a module path: torch.nn.modules.linear.Linear, or a custom op ns.op.overload
        head, _, tail = n.rpartition(".")
        if tail[:1].isupper():
            return tail
        return ""  # custom namespace op: unknown
    return n


def op_class(op_name: str) -> str:
    """Map an ATen op name or an nn.Module class name to one of ``OP_CLASSES``.

    Namespace and overload are dropped (``aten.addmm.default`` -> ``addmm``), an in-place
    trailing underscore too (``aten.add_.Tensor`` -> ``add``). Ops of other namespaces
    (custom and fused ops such as ``mylib.fused_softmax.default``) are ``"unknown"``.

    Args:
        op_name: e.g. ``"aten.mm.default"``, ``"aten::bmm"``, ``"Conv2d"``,
            ``"torch.nn.modules.normalization.LayerNorm"``.

    Returns:
        The op class string.

    Example:
        >>> op_class("aten.addmm.default"), op_class("LayerNorm"), op_class("aten.gelu")
        ('matmul', 'normalization', 'elementwise')
    """
    base = _base_name(op_name)
    if base.endswith("_") and not base.startswith("_"):
        base = base[:-1]
    for cls, names in _TABLES:
        if base in names:
            return cls
    return "unknown"

import functools

import torch


def fused_kernels_apply(x: torch.Tensor) -> bool:
    """Whether `layers/fused.py`'s Triton kernels replace the eager ops for x: on CUDA, outside
    autograd (the kernels have no backward; drafter training runs the eager ops)."""
    return x.is_cuda and not torch.is_grad_enabled()


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
          norm: torch.nn.Module | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, of `norm(x)` where an RMSNorm `norm` is given; one row on
    CUDA goes through `layers/gemv.py`'s kernel (the norm inside it, its rounding kept)."""
    if fused_kernels_apply(x):
        from flashtree.layers.gemv import gemv, gemv_applies

        if gemv_applies(x, weight):
            y = gemv(x, weight, norm=None if norm is None else (norm.weight, norm.eps))
            return y if bias is None else y + bias
    return torch.nn.functional.linear(x if norm is None else norm(x), weight, bias)


def dense_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(x.float(), weight)` for a float32 weight (a router kept in float32); on CUDA
    one row, or a verify's few, go through `layers/gemv.py`'s kernels, which widen x as they
    read it."""
    if fused_kernels_apply(x):
        from flashtree.layers.gemv import gemv, gemv_applies, gemv_rows, gemv_rows_applies

        if gemv_applies(x, weight):
            return gemv(x, weight)
        if gemv_rows_applies(x, weight):
            return gemv_rows(x, weight)
    return torch.nn.functional.linear(x.float(), weight.float())


@functools.cache
def programs_to_fill(device: torch.device) -> int:
    """Programs that keep every SM of `device` busy (two per SM), for kernels that size their
    grids to it; on the interpreter a small count, so that tests take small shapes through
    every launch shape."""
    if device.type != "cuda":
        return 32
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count

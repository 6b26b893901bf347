import torch


def fused_kernels_apply(x: torch.Tensor) -> bool:
    """Whether `layers/fused.py`'s Triton kernels replace the eager ops for x: on CUDA, outside
    autograd (the kernels have no backward; drafter training runs the eager ops)."""
    return x.is_cuda and not torch.is_grad_enabled()


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """`F.linear(x, weight, bias)`; one row on CUDA goes through `layers/gemv.py`'s kernel."""
    if fused_kernels_apply(x):
        from flashtree.layers.gemv import gemv, gemv_applies

        if gemv_applies(x, weight):
            y = gemv(x, weight)
            return y if bias is None else y + bias
    return torch.nn.functional.linear(x, weight, bias)

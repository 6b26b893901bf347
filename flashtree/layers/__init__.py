import torch


def fused_kernels_apply(x: torch.Tensor) -> bool:
    """Whether `layers/fused.py`'s Triton kernels replace the eager ops for x: on CUDA, outside
    autograd (the kernels have no backward; drafter training runs the eager ops)."""
    return x.is_cuda and not torch.is_grad_enabled()

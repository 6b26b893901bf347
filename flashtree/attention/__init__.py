from flashtree.attention.backend import AttentionBackend, AttentionMetadata
from flashtree.attention.sdpa import SdpaBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "SdpaBackend"]

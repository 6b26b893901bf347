"""flashtree: speculative decoding with DFlash block drafters and DDTree draft trees."""

from flashtree.llm import LLM
from flashtree.outputs import CompletionOutput, RequestOutput
from flashtree.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"

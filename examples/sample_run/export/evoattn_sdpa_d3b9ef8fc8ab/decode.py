"""The decode problem's cache lengths, as hf.py hands them to the layers in place of a mask."""
from ._problems.decode_op import is_lengths, mask_lengths, visible

__all__ = ["is_lengths", "mask_lengths", "visible"]

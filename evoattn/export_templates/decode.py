"""The decode problem's op as this package has it: its fallback, its lengths mask and the
transformers calls it serves (hf.py reads them here). The rule of each is written, with the
calls a decode kernel takes, in `_problems/decode_op.py`."""
from ._problems.decode_op import (MAX_SQ, SCHEMA, fallback, hf_call, is_lengths, mask_lengths,
                                  op_spec, shape_refusal, visible)

__all__ = ["MAX_SQ", "SCHEMA", "fallback", "hf_call", "is_lengths", "mask_lengths", "op_spec",
           "shape_refusal", "visible"]

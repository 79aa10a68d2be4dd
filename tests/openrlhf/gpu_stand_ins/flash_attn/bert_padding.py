"""Names OpenRLHF imports from ``flash_attn.bert_padding``; see the package docstring."""

from flash_attn._unavailable import unavailable

index_first_axis = pad_input = rearrange = unpad_input = unavailable

"""Names OpenRLHF imports from ``flash_attn.utils.distributed``; see the package docstring."""

from flash_attn._unavailable import unavailable

all_gather = unavailable

"""A stand-in for flash-attn, which has no CPU build: its wheel compiles CUDA
kernels, and its package imports them on import. OpenRLHF 0.11.2 imports
``flash_attn.bert_padding`` and ``flash_attn.utils.distributed`` at the top of
``openrlhf.models.ring_attn_utils`` (packed samples and ring attention), so
nothing of OpenRLHF's model code imports without it. The tests put this
folder on ``PYTHONPATH``; it provides those names only, and each raises if
called: the paths that use them (``--ds.packing_samples``, ring attention)
need a GPU and are not run here."""

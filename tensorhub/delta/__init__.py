"""Delta versions: only the elements that changed since an earlier version (``codec``)."""

"""CaSync: compression-aware gradient synchronisation (HiPress Sec. 3)."""

"""Framework front ends (thin: hooks, casts, lazy imports)."""

"""Context toolkit (client side, no torch): count, fit, chunk and assemble text for a window."""

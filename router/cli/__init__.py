"""`router serve | boxes | demo`."""

"""The APIs clients speak, as tables of routes plus small functions (no copied handlers)."""

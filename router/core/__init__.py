"""The rules of the router: pure, stdlib only, no I/O, no clock, no imports from the rest of router."""

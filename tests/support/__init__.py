"""Helpers that several test files share, grouped by what they do. A test file imports them from
here, never from another test file (tests/test_suite_layout.py); pytest collects no test from
this package (its files are not named test_*.py).

- calls.py: a caller's JSON requests to a router, from a chosen loopback address; keys
- raw_calls.py: requests as bytes, raw sockets, and the router's own record of its calls
- url_calls.py: requests by URL (a router started outside the fixtures), with or without a key
- conversations.py: chat calls through the `openai` client, for cache-aware routing
- boxes.py: a box that answers raw bytes, faked GPU cards, and what a simulated box saw
- several_routers.py: router processes over the same boxes, and the shared server
- installed.py: the installed `hugpy-router` script and a clean environment for it
- machines.py: a table machine of core and its plain model, stepped together; what a table reaches
"""

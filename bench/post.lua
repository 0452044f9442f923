-- wrk script: one non-streaming chat completion per request (POST JSON, keep-alive).
-- The body is the smallest valid call: the router reads `model` from it and the sim box
-- answers a fixed ~430 B JSON with a Content-Length, so a run measures per-call overhead.
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"tiny-llama","messages":[{"role":"user","content":"hi"}]}'

dofile((debug.getinfo(1, "S").source:match("^@(.*/)") or "") .. "wrk_report.lua")

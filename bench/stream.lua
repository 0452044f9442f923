-- wrk script: one streamed chat completion per request (POST JSON with "stream": true).
--
-- The sim box answers SSE (1 role frame + N content frames + a final frame + [DONE]) and ends
-- it by closing the connection (no length, no chunking). The router re-frames it with chunked
-- encoding on a keep-alive connection, so wrk sees the end of each message normally.
--
-- Direct to the box, wrk's parser completes the close-delimited message at EOF and counts the
-- request (with its full latency and all its bytes), but then also counts one read error and
-- reconnects twice (the second connection is opened and dropped unused). bench/run.py
-- subtracts that one read error per completed stream and reports the extra connection; see
-- the "direct streams" note in its docstring.
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"tiny-llama","messages":[{"role":"user","content":"hi"}],"stream":true}'

dofile((debug.getinfo(1, "S").source:match("^@(.*/)") or "") .. "wrk_report.lua")

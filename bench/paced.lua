-- wrk script: post.lua's call, each connection pausing PACE_MS between its calls, so that a run
-- offers a steady rate below what the proxy can take (the CPU a call costs at a given load, not
-- at saturation). PACE_MS comes from the environment (default 20).
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"tiny-llama","messages":[{"role":"user","content":"hi"}]}'

local pace_ms = tonumber(os.getenv("PACE_MS") or "20")

function delay()
  return pace_ms
end

dofile((debug.getinfo(1, "S").source:match("^@(.*/)") or "") .. "wrk_report.lua")

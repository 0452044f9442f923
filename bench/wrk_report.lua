-- Shared by post.lua and stream.lua: at the end of a run, print one machine-readable line
-- ("BENCH_JSON {...}") with exact counts and latency percentiles in microseconds, so that
-- bench/run.py does not have to parse wrk's rounded human-readable summary.
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCH_JSON {"requests": %d, "duration_us": %d, "bytes": %d, ' ..
    '"connect_errors": %d, "read_errors": %d, "write_errors": %d, "status_errors": %d, ' ..
    '"timeouts": %d, "p50_us": %d, "p90_us": %d, "p99_us": %d, "p999_us": %d, ' ..
    '"mean_us": %.1f, "max_us": %d}\n',
    summary.requests, summary.duration, summary.bytes,
    e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency:percentile(99.9), latency.mean, latency.max))
end

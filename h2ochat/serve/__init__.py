"""`h2ochat serve`: an OpenAI-compatible HTTP server over one model and a batch of fixed-budget caches.

One module per job:

- ``api``: request bodies in, validated ``RequestParams`` out (lenient about unknown fields);
- ``errors``: failures in the OpenAI shape (``{"error": {...}}``) with their HTTP status;
- ``responses``: the JSON bodies and server-sent-event chunks a client expects;
- ``sequence``: one choice being generated: sampling, text, stop strings, finish reason, events;
- ``scheduler``: continuous batching over N rows (admission, one prefill chunk per step, recycling,
  cancellation), with the model behind a small backend interface so it can be tested with a fake;
- ``backend``: that interface on a real model and an ``H2OCache`` of N rows;
- ``parked``: caches of finished conversations, parked in host memory, found by token prefix;
- ``engine``: the thread that owns the model and runs the scheduler, and the hand-over to asyncio;
- ``metrics``: counters and gauges in Prometheus text;
- ``app``: the Starlette application (routes, auth, streaming, disconnects).
"""

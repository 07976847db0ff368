"""`h2ochat serve`: an OpenAI-compatible HTTP server over one model and a batch of fixed-budget caches.

One module per job:

- ``api``: request bodies in, validated ``RequestParams`` out (lenient about unknown fields);
- ``errors``: failures in the OpenAI shape (``{"error": {...}}``) with their HTTP status;
- ``responses``: the JSON bodies and server-sent-event chunks a client expects;
- ``sequence``: one choice being generated: sampling, text, stop strings, finish reason, events;
- ``scheduler``: continuous batching over N rows (admission, one prefill chunk per step, recycling,
  cancellation), with the model behind a small backend interface so it can be tested with a fake;
- ``rows``: the row pool: an ``H2OCache`` of N rows, the buckets a decode step runs, parking;
- ``runner``: the model runner: the prefill and decode forwards over the cache the pool hands it;
- ``backend``: that interface on a real model, the pool and the runner put together;
- ``sampling``: every row's next token of a step in one draw (the exponential race);
- ``parked``: caches of finished conversations, parked in host memory, found by token prefix;
- ``engine``: the thread that owns the model and runs the scheduler, and the hand-over to asyncio;
- ``metrics``: counters and gauges for ``/metrics`` (rendered by ``prometheus_client``);
- ``app``: the Starlette application (routes, auth, streaming, disconnects).
"""

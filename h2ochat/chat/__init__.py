"""The chat and what a person sees of a run. A conversation on one cache, feeding only what is new
(``conversation``), its settings and ``/set`` table (``settings``), the REPL (``repl``), the Rich
status line, cache view and progress (``ui``, ``prompt_progress``), the figures they show
(``split``: how a cache's slots split) and a run's JSON record (``report``, which ``generate`` and
``story`` print too), the kept conversations (``history``), prompts and templates (``prompting``)
and how a reply ends (``replies``). It runs on the engine; the measurements and the server build
on it."""

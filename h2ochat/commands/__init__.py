"""The sub-commands, one module each (``run``, ``generate``, ``story``, ``eval`` with its pass-key and
RULER tasks, ``bench``, ``serve``, ``history``, ``models``), each exposing ``register(app)``; what they
share is in ``common``, and ``story``'s files, rows and report in ``story_files``, ``story_rows`` and
``story_report``. A command reads its options (``h2ochat.options``), loads the model
(``h2ochat.loading``) and hands the work to the chat, the measurements or the server: it holds the
command line's wording, not the work. Only ``h2ochat.cli`` imports them."""

"""The wire between the web and the scheduler daemons, shared by both sides.

- ``protocol``: Redis keys and message shapes (jobs, events, cancels, heartbeats, control)
- ``errors``: the one table of error codes, each with its HTTP status and OpenAI type
- ``status``: a request's statuses in the history
- ``sampling``, ``messages``, ``grammar_check``, ``schema_check``: request validation
  (sampling parameters, chat messages, GBNF grammar bounds, JSON-schema bounds)

Nothing here imports Django or llama_cpp.
"""

"""The scheduler daemon, in three layers; imports go one way, service → core ← llama.

- ``core/``: the inference core and its policy, pure Python: ``InferenceCore``
  (``core/inference.py``: engine + scheduler + the tick thread), the scheduler and its
  plan, request and slot state, the fair queue, the prefix and RAM caches, embeddings
  batching, chat templates (over the engine's ``TemplateSource``), incremental text, the
  lifecycle and the loop clock. It imports neither Redis nor the service modules; it reaches
  llama.cpp only through the shapes in ``core/engine_api.py``, except
  ``InferenceCore.from_settings``, which builds the real engine.
- ``llama/``: the only code that imports ``llama_cpp``: the generation context
  (``llama/engine.py``), the sampler and logprobs (``llama/sampler.py``), the embeddings
  context (``llama/embedder.py``), llama.cpp's log (``llama/logs.py``).
- ``service/``: what faces Redis and the process: intake, the event writer, recovery,
  control, the heartbeat, the watch, the history sink's protocol, the supervisor, and
  ``service/daemon.py``, which puts them together around one ``InferenceCore``.

``management/commands/run_scheduler.py`` is the composition root. tests/test_layers.py
checks the rules: no import cycle, llama_cpp only under ``llama/``, nothing of Redis or of
``service/`` under ``core/``.
"""

"""Pure policy: the inference core, the scheduler and what it decides with.

No Redis, no service module, no ``llama_cpp`` (see ``scheduler_daemon/__init__.py``)."""

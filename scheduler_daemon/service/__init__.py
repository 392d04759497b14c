"""The Redis-facing service around one ``InferenceCore``.

Intake, events out, recovery, control, heartbeat, watch, the supervisor; ``daemon.py`` puts
them together."""

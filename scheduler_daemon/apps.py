from django.apps import AppConfig


class SchedulerDaemonConfig(AppConfig):
    """The scheduler daemon: owns the model, slots, batching loop and caches."""

    name = "scheduler_daemon"
    verbose_name = "Scheduler daemon"

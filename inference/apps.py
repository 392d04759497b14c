from django.apps import AppConfig


class InferenceConfig(AppConfig):
    """The OpenAI-style API: request history, REST views, the playground."""

    name = "inference"

    def ready(self) -> None:
        from inference import adapters  # noqa: F401  (a deleted adapter is unloaded)

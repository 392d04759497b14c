from django.apps import AppConfig


class InferenceConfig(AppConfig):
    """The OpenAI-style API: request history, REST views, the playground."""

    name = "inference"

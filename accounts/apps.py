from django.apps import AppConfig


class AccountsConfig(AppConfig):
    """Tenants, their API keys, and how a request is authenticated."""

    name = "accounts"

"""What create_tenant and create_api_key share: a tenant's slug, and a ``--name``."""

from typing import Any

from django.core.management.base import BaseCommand, CommandParser


class TenantCommand(BaseCommand):
    """A command about one tenant: ``<slug> [--name NAME]``; ``handle_tenant`` does the work."""

    slug_help = "the tenant's slug"
    name_default = ""
    name_help = ""

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("slug", help=self.slug_help)
        parser.add_argument("--name", default=self.name_default, help=self.name_help)

    def handle(self, *args: Any, slug: str, name: str, **options: Any) -> None:
        self.handle_tenant(slug, name)

    def handle_tenant(self, slug: str, name: str) -> None:
        raise NotImplementedError

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from accounts.models import Tenant


class Command(BaseCommand):
    help = "Create a tenant. Then: manage.py create_api_key <slug>"

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("slug", help="unique short name, e.g. acme")
        parser.add_argument("--name", default="", help="display name (default: the slug)")

    def handle(self, *args: Any, slug: str, name: str, **options: Any) -> None:
        if Tenant.objects.filter(slug=slug).exists():
            raise CommandError(f"Tenant {slug!r} already exists.")
        tenant = Tenant(slug=slug, name=name or slug)
        tenant.full_clean()
        tenant.save()
        self.stdout.write(f"Created tenant {tenant.slug} ({tenant.name}).")

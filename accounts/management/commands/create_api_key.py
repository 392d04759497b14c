from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from accounts.models import ApiKey, Tenant


class Command(BaseCommand):
    help = "Issue an API key for a tenant. The key is printed once, as the last line."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("tenant", help="the tenant's slug")
        parser.add_argument("--name", default="default", help="a label for the key")

    def handle(self, *args: Any, tenant: str, name: str, **options: Any) -> None:
        try:
            owner = Tenant.objects.get(slug=tenant)
        except Tenant.DoesNotExist:
            message = f"No tenant {tenant!r}. Create it: manage.py create_tenant {tenant}"
            raise CommandError(message) from None
        api_key, plaintext = ApiKey.issue(owner, name)
        self.stdout.write(f"API key {api_key.name!r} for tenant {owner.slug} (shown only now):")
        self.stdout.write(plaintext)

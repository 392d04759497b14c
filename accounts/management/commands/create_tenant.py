from django.core.management.base import CommandError

from accounts.management.commands._tenant_command import TenantCommand
from accounts.models import Tenant


class Command(TenantCommand):
    help = "Create a tenant. Then: manage.py create_api_key <slug>"
    slug_help = "unique short name, e.g. acme"
    name_help = "display name (default: the slug)"

    def handle_tenant(self, slug: str, name: str) -> None:
        if Tenant.objects.filter(slug=slug).exists():
            raise CommandError(f"Tenant {slug!r} already exists.")
        tenant = Tenant(slug=slug, name=name or slug)
        tenant.full_clean()
        tenant.save()
        self.stdout.write(f"Created tenant {tenant.slug} ({tenant.name}).")

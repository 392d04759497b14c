from django.core.management.base import CommandError

from accounts.management.commands._tenant_command import TenantCommand
from accounts.management.hint import manage_py
from accounts.models import ApiKey, Tenant


class Command(TenantCommand):
    help = "Issue an API key for a tenant. The key is printed once, as the last line."
    name_default = "default"
    name_help = "a label for the key"

    def handle_tenant(self, slug: str, name: str) -> None:
        try:
            owner = Tenant.objects.get(slug=slug)
        except Tenant.DoesNotExist:
            message = f"No tenant {slug!r}. Create it: {manage_py(f'create_tenant {slug}')}"
            raise CommandError(message) from None
        api_key, plaintext = ApiKey.issue(owner, name)
        self.stdout.write(f"API key {api_key.name!r} for tenant {owner.slug} (shown only now):")
        self.stdout.write(plaintext)

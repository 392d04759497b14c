import secrets
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from django.db import transaction

from accounts.management.hint import manage_py
from accounts.models import ApiKey, Tenant

DEMO_SLUG = "demo"
ADMIN_USERNAME = "admin"


class Command(BaseCommand):
    help = "Create, once, a demo tenant with an API key and an admin superuser."

    @transaction.atomic
    def handle(self, *args: Any, **options: Any) -> None:
        self.seed_tenant()
        self.seed_superuser()

    def seed_tenant(self) -> None:
        tenant, created = Tenant.objects.get_or_create(slug=DEMO_SLUG, defaults={"name": "Demo"})
        if not created:
            self.stdout.write(
                f"Demo tenant exists. Another key: {manage_py(f'create_api_key {DEMO_SLUG}')}"
            )
            return
        _, plaintext = ApiKey.issue(tenant, "demo")
        self.stdout.write(self.style.SUCCESS(f"Demo tenant API key (shown only now): {plaintext}"))

    def seed_superuser(self) -> None:
        users = get_user_model().objects
        if users.filter(is_superuser=True).exists():
            self.stdout.write(
                "Admin superuser exists. New password: "
                f"{manage_py(f'changepassword {ADMIN_USERNAME}')}"
            )
            return
        password = secrets.token_urlsafe(12)
        users.create_superuser(ADMIN_USERNAME, "admin@localhost", password)
        self.stdout.write(
            self.style.SUCCESS(f"Admin login (shown only now): {ADMIN_USERNAME} / {password}")
        )

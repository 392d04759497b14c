"""``manage.py invite <tenant-slug> <email> [--role owner|member|viewer]``: a console user."""

from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from accounts.management.hint import manage_py
from accounts.models import Membership, Tenant
from console.forms import InviteForm, invite


class Command(BaseCommand):
    help = ("Invite a user to a tenant's console: mails the link that sets a password "
            "(EMAIL_BACKEND; the console backend prints it) and prints the link.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("slug", help="the tenant's slug")
        parser.add_argument("email", help="the user's email, also the user name")
        parser.add_argument("--role", choices=Membership.Role.values,
                            default=Membership.Role.MEMBER, help="default: member")

    def handle(self, *args: Any, slug: str, email: str, role: str, **options: Any) -> None:
        tenant = Tenant.objects.filter(slug=slug).first()
        if tenant is None:
            message = f"No tenant {slug!r}. Create it: {manage_py(f'create_tenant {slug}')}"
            raise CommandError(message)
        form = InviteForm({"email": email, "tenant": tenant.pk, "role": role})
        if not form.is_valid():
            problems = "; ".join(f"{name}: {' '.join(errors)}"
                                 for name, errors in form.errors.items())
            raise CommandError(problems)
        data = form.cleaned_data
        _, link = invite(data["email"], tenant, role, base_url=settings.CONSOLE_URL,
                         actor_name="manage.py invite")
        self.stdout.write(f"Invited {data['email']} to {tenant.slug} as {role}; the link that "
                          f"sets the password (valid {settings.PASSWORD_RESET_TIMEOUT // 3600} h):")
        self.stdout.write(link)

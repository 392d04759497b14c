"""``manage.py adapters add|list|delete``: tenants' LoRA adapters (docs/adapters.md)."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from accounts.models import Tenant
from inference import adapters
from inference.models import Adapter


class Command(BaseCommand):
    help = ("Register, list or delete tenants' LoRA adapters. A file is checked when it is "
            "added (inside ADAPTERS_DIR, a GGUF LoRA for the base model); deleting one tells "
            "the live daemons of its model to unload it.")

    def add_arguments(self, parser: CommandParser) -> None:
        actions = parser.add_subparsers(dest="action", required=True)
        add = actions.add_parser("add", help="register an adapter file for a tenant")
        add.add_argument("--tenant", required=True, help="the tenant's slug or id")
        add.add_argument("--model", required=True, help="the base model's name")
        add.add_argument("--name", required=True,
                         help="what requests name it by: <model>:<name>")
        add.add_argument("--file", required=True,
                         help="the GGUF file, relative to ADAPTERS_DIR (or absolute, inside it)")
        add.add_argument("--scale", type=float, default=1.0,
                         help="its default scale, in (0, 4] (default 1)")
        listing = actions.add_parser("list", help="the adapters, one a line")
        listing.add_argument("--tenant", help="only this tenant's (slug or id)")
        delete = actions.add_parser("delete", help="delete an adapter (by id, or by "
                                                   "--tenant --model --name)")
        delete.add_argument("key", nargs="?", help="its id (ad_...)")
        delete.add_argument("--tenant")
        delete.add_argument("--model")
        delete.add_argument("--name")

    def handle(self, *args: Any, action: str, **options: Any) -> None:
        getattr(self, f"_{action}")(**options)

    def _add(self, tenant: str, model: str, name: str, file: str, scale: float,
             **_: Any) -> None:
        row = Adapter(tenant=_tenant(tenant), model=model, name=name, file=file,
                      default_scale=scale)
        try:
            row.full_clean()
        except ValidationError as exc:
            raise CommandError("; ".join(f"{field}: {' '.join(messages)}" for field, messages
                                         in exc.message_dict.items())) from None
        row.save()
        self.stdout.write(f"{row.key} {row.tenant.slug} {row} rank {row.rank} "
                          f"{row.size_bytes} bytes sha256 {row.sha256}")

    def _list(self, tenant: str | None = None, **_: Any) -> None:
        rows = Adapter.objects.select_related("tenant")
        if tenant is not None:
            rows = rows.filter(tenant=_tenant(tenant))
        for row in rows:
            self.stdout.write(f"{row.key}\t{row.tenant.slug}\t{row}\tscale "
                              f"{row.default_scale:g}\trank {row.rank}\t{row.file}")

    def _delete(self, key: str | None = None, tenant: str | None = None,
                model: str | None = None, name: str | None = None, **_: Any) -> None:
        if key is not None:
            row = Adapter.objects.filter(key=key).first()
        elif tenant and model and name:
            row = Adapter.objects.filter(tenant=_tenant(tenant), model=model, name=name).first()
        else:
            raise CommandError("name the adapter: its id, or --tenant, --model and --name")
        if row is None:
            raise CommandError("no such adapter")
        with transaction.atomic():
            row.delete()  # its daemons are told to unload it once this commits
        daemons = adapters.live_daemons_of(row.model)
        self.stdout.write(f"deleted {row.key} ({row}); unload_adapter sent to "
                          f"{', '.join(daemons) or 'no live daemon'}")


def _tenant(value: str) -> Tenant:
    found = Tenant.objects.filter(slug=value).first()
    if found is None and value.isascii() and value.isdigit():
        found = Tenant.objects.filter(pk=int(value)).first()
    if found is None:
        raise CommandError(f"no tenant {value!r} (a slug or an id)")
    return found

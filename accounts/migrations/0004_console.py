import django.db.models.deletion
import django.utils.timezone
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("accounts", "0003_tenant_max_queued"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.AddField(
            model_name="apikey",
            name="expires_at",
            field=models.DateTimeField(
                blank=True, help_text="after this the key no longer works; blank: never",
                null=True),
        ),
        migrations.AddField(
            model_name="apikey",
            name="allowed_models",
            field=models.JSONField(
                blank=True, default=list,
                help_text='model names (or "<model>:<adapter>") the key may use; empty: '
                          'every model'),
        ),
        migrations.AddField(
            model_name="apikey",
            name="read_only",
            field=models.BooleanField(default=False,
                                      help_text="history and usage only: no inference"),
        ),
        migrations.AddField(
            model_name="apikey",
            name="requests_per_minute",
            field=models.PositiveIntegerField(
                blank=True, help_text="the key's own limit within the tenant's; blank: none",
                null=True),
        ),
        migrations.AddField(
            model_name="apikey",
            name="tokens_per_minute",
            field=models.PositiveIntegerField(
                blank=True, help_text="the key's own limit within the tenant's; blank: none",
                null=True),
        ),
        migrations.AddField(
            model_name="apikey",
            name="monthly_token_budget",
            field=models.PositiveBigIntegerField(
                blank=True, help_text="the key's own limit within the tenant's; blank: none",
                null=True),
        ),
        migrations.AddField(
            model_name="apikey",
            name="rotated_from",
            field=models.ForeignKey(
                blank=True, editable=False, help_text="the key this one replaced (rotation)",
                null=True, on_delete=django.db.models.deletion.SET_NULL,
                related_name="rotated_to", to="accounts.apikey"),
        ),
        migrations.AddField(
            model_name="apikey",
            name="created_by",
            field=models.ForeignKey(
                blank=True, editable=False, null=True,
                on_delete=django.db.models.deletion.SET_NULL, related_name="+",
                to=settings.AUTH_USER_MODEL),
        ),
        migrations.CreateModel(
            name="Membership",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False,
                                           verbose_name="ID")),
                ("role", models.CharField(
                    choices=[("owner", "Owner"), ("member", "Member"), ("viewer", "Viewer")],
                    default="member", max_length=16)),
                ("created", models.DateTimeField(auto_now_add=True)),
                ("invited_by", models.ForeignKey(
                    blank=True, editable=False, null=True,
                    on_delete=django.db.models.deletion.SET_NULL, related_name="+",
                    to=settings.AUTH_USER_MODEL)),
                ("tenant", models.ForeignKey(
                    on_delete=django.db.models.deletion.CASCADE, related_name="memberships",
                    to="accounts.tenant")),
                ("user", models.OneToOneField(
                    on_delete=django.db.models.deletion.CASCADE, related_name="membership",
                    to=settings.AUTH_USER_MODEL)),
            ],
            options={"ordering": ["tenant", "user__username"]},
        ),
        migrations.CreateModel(
            name="AuditEvent",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False,
                                           verbose_name="ID")),
                ("actor_name", models.CharField(
                    blank=True, help_text="who, as named then (a user, or a command)",
                    max_length=150)),
                ("action", models.CharField(
                    choices=[("key.create", "key created"), ("key.revoke", "key revoked"),
                             ("key.rotate", "key rotated"), ("key.update", "key changed"),
                             ("tenant.limits", "tenant limits changed"),
                             ("member.invite", "member invited"),
                             ("member.update", "member changed"),
                             ("member.remove", "member removed")],
                    max_length=32)),
                ("target", models.CharField(blank=True, max_length=200)),
                ("detail", models.JSONField(blank=True, default=dict)),
                ("address", models.GenericIPAddressField(blank=True, null=True)),
                ("created", models.DateTimeField(db_index=True,
                                                 default=django.utils.timezone.now)),
                ("actor", models.ForeignKey(
                    blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL,
                    related_name="+", to=settings.AUTH_USER_MODEL)),
                ("tenant", models.ForeignKey(
                    blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL,
                    related_name="audit_events", to="accounts.tenant")),
            ],
            options={
                "ordering": ["-created"],
                "indexes": [models.Index(fields=["tenant", "-created"],
                                         name="audit_tenant_created")],
            },
        ),
    ]

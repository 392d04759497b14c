from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("accounts", "0002_tenant_limits"),
    ]

    operations = [
        migrations.AddField(
            model_name="tenant",
            name="max_queued",
            field=models.PositiveIntegerField(
                blank=True,
                help_text="requests waiting in a daemon's queue at once; blank: MAX_QUEUE_PER_TENANT",
                null=True,
            ),
        ),
    ]

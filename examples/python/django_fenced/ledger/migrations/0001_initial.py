from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True
    dependencies: list = []
    operations = [
        migrations.CreateModel(
            name="Entry",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("term", models.BigIntegerField()),
                ("n", models.IntegerField()),
            ],
        ),
    ]

from accounts.authentication import authenticate_key
from accounts.models import ApiKey
from inference.models import InferenceRequest


def test_adding_a_key_shows_the_secret_once(admin_client, parties):
    response = admin_client.post(
        "/admin/accounts/apikey/add/", {"tenant": parties.b.pk, "name": "from-admin"}, follow=True
    )
    assert response.status_code == 200
    shown = [str(m) for m in response.context["messages"] if "shown only now" in str(m)]
    assert len(shown) == 1
    plaintext = next(word for word in shown[0].split() if word.startswith("sk-"))
    api_key = authenticate_key(plaintext)
    assert api_key.name == "from-admin"
    assert api_key.tenant == parties.b
    page = admin_client.get(f"/admin/accounts/apikey/{api_key.pk}/change/")
    assert plaintext not in page.content.decode()


def test_revoke_action(admin_client, parties):
    response = admin_client.post(
        "/admin/accounts/apikey/",
        {"action": "revoke_keys", "_selected_action": [parties.owner_key.pk]},
    )
    assert response.status_code == 302
    assert ApiKey.objects.get(pk=parties.owner_key.pk).revoked_at is not None
    assert authenticate_key(parties.owner) is None
    assert authenticate_key(parties.member) is not None


def test_history_admin_is_read_only(admin_client, parties):
    row = InferenceRequest.objects.create(tenant=parties.a, kind="chat", model="m")
    assert admin_client.get("/admin/inference/inferencerequest/").status_code == 200
    assert (
        admin_client.get(f"/admin/inference/inferencerequest/{row.pk}/change/").status_code == 200
    )
    assert admin_client.get("/admin/inference/inferencerequest/add/").status_code == 403
    assert (
        admin_client.get(f"/admin/inference/inferencerequest/{row.pk}/delete/").status_code == 403
    )

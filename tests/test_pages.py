def test_playground_page(client, db):
    response = client.get("/playground/")
    assert response.status_code == 200
    assert b"inference/playground.js" in response.content and b"load-models" in response.content


def test_root_redirects_to_playground(client, db):
    response = client.get("/")
    assert response.status_code == 302
    assert response["Location"] == "/playground/"


def test_admin_login_page(client, db):
    assert client.get("/admin/login/").status_code == 200


def test_html_404_outside_the_api(client, db):
    response = client.get("/no-such-page/")
    assert response.status_code == 404
    assert not response["Content-Type"].startswith("application/json")

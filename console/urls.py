"""The tenant console's routes (docs/console.md), mounted at /console/."""

from django.urls import path

from console import usage_views, views

app_name = "console"

urlpatterns = [
    path("", views.home, name="home"),
    # Django's auth views (login rate-limited by django-axes; a reset link is an invite's too)
    path("login/", views.LoginView.as_view(), name="login"),
    path("logout/", views.LogoutView.as_view(), name="logout"),
    path("password/", views.PasswordChangeView.as_view(), name="password_change"),
    path("password/done/", views.PasswordChangeDoneView.as_view(), name="password_change_done"),
    path("password/reset/", views.PasswordResetView.as_view(), name="password_reset"),
    path("password/reset/sent/", views.PasswordResetDoneView.as_view(),
         name="password_reset_done"),
    path("password/reset/<uidb64>/<token>/", views.PasswordResetConfirmView.as_view(),
         name="password_reset_confirm"),
    path("password/reset/done/", views.PasswordResetCompleteView.as_view(),
         name="password_reset_complete"),
    # keys
    path("keys/", views.keys, name="keys"),
    path("keys/new/", views.key_new, name="key_new"),
    path("keys/<int:pk>/", views.key_detail, name="key_detail"),
    path("keys/<int:pk>/rotate/", views.key_rotate, name="key_rotate"),
    path("keys/<int:pk>/revoke/", views.key_revoke, name="key_revoke"),
    # requests, audit
    path("requests/", views.requests, name="requests"),
    path("requests/<uuid:pk>/", views.request_detail, name="request_detail"),
    path("audit/", views.audit, name="audit"),
    # usage (console/usage_views.py)
    path("usage/", usage_views.usage, name="usage"),
    path("usage.csv", usage_views.usage_csv, name="usage_csv"),
]

"""The console's pages (stubs: being built)."""
from django.contrib.auth import views as auth_views
from django.http import HttpResponse


def _todo(request, *args, **kwargs):
    return HttpResponse("not yet", status=501)


home = keys = key_new = key_detail = key_rotate = key_revoke = _todo
requests = request_detail = audit = _todo
LoginView = auth_views.LoginView
LogoutView = auth_views.LogoutView
PasswordChangeView = auth_views.PasswordChangeView
PasswordChangeDoneView = auth_views.PasswordChangeDoneView
PasswordResetView = auth_views.PasswordResetView
PasswordResetDoneView = auth_views.PasswordResetDoneView
PasswordResetConfirmView = auth_views.PasswordResetConfirmView
PasswordResetCompleteView = auth_views.PasswordResetCompleteView
